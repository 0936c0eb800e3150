"""DSpark drafts' configuration (DeepSpec's ``Qwen3DSparkModel`` config.json): the DFlash-style
backbone, the sequential head (Markov, gated or RNN, of rank ``markov_rank``; rank 0: none, which
is DeepSpec's DFlash) and the confidence head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import get_field
from mtp_jax.drafts.dflash.config import DFlashConfig, parse_dflash_config
from mtp_jax.errors import ConfigError

HEAD_TYPES = ("vanilla", "gated", "rnn")
"""``markov_head_type``: the paper's low-rank Markov bias, its gated form, the gated RNN head."""


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """A DSpark draft (docs/formats.md, "DSpark drafts").

    ``backbone``: its decoder layers, block and mask token, read as a DFlash draft's (the same
    layers; DSpark reads the block's rows 0..B-1, the anchor's included, where DFlash reads 1..B-1).
    ``target_layer_ids``: the captured target layer outputs as written (-1: the embedding output);
    ``capture``: the same for the step (:class:`mtp_jax.targets.base.CapturePlan` numbers them the
    same way), resolved at load against the target's depth.
    ``markov_rank`` r (0: no sequential head), ``markov_head_type`` (:data:`HEAD_TYPES`),
    ``confidence_head`` and whether its features include W1[x_{k-1}] (``confidence_with_markov``).
    ``confidence_temperatures``: the sequential temperature scaling fitted on held-out rollouts (one
    per block slot; an mtp-jax field, absent from DeepSpec's configs: None until calibrated).
    ``confidence_shifts``: added to each slot's logit after its temperature (mtp-jax's extension:
    :func:`mtp_jax.drafts.dspark.calibration.fit_scaling`; None: no shift).
    """

    backbone: DFlashConfig
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = True
    confidence_temperatures: tuple[float, ...] | None = None
    confidence_shifts: tuple[float, ...] | None = None
    architecture: str = "Qwen3DSparkModel"
    capture: tuple[int, ...] = ()

    @property
    def block_size(self) -> int:
        return self.backbone.block_size

    @property
    def mask_token_id(self) -> int:
        return self.backbone.mask_token_id

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.backbone.num_hidden_layers

    @property
    def vocab_size(self) -> int | None:
        return self.backbone.vocab_size

    @property
    def draft_vocab_size(self) -> int | None:
        """A draft vocabulary (mtp-jax's extension, as DFlash's: ``draft_vocab_size`` with ``d2t``):
        the block's head and the Markov head's W2 cover those target ids only; None: all of them."""
        return self.backbone.draft_vocab_size

    @property
    def confidence_width(self) -> int:
        """The confidence head's input: h_k, and W1[x_{k-1}] when it reads the Markov feature."""
        with_markov = self.markov_rank > 0 and self.confidence_with_markov
        return self.hidden_size + (self.markov_rank if with_markov else 0)

    def resized(self, block_size: int) -> DSparkConfig:
        """The same draft run on a smaller block (its first ``block_size`` slots)."""
        temps, shifts = self.confidence_temperatures, self.confidence_shifts
        return dataclasses.replace(
            self,
            backbone=dataclasses.replace(self.backbone, block_size=block_size),
            confidence_temperatures=None if temps is None else temps[:block_size],
            confidence_shifts=None if shifts is None else shifts[:block_size],
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DSparkConfig:
        return parse_dspark_config(raw)


def is_dspark_config(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json is a DSpark draft's (DeepSpec's architectures end in ``DSparkModel``)."""
    return any("dspark" in str(a).lower() for a in raw.get("architectures") or [])


def _layer_ids(raw: Mapping[str, Any]) -> tuple[int, ...]:
    ids = raw.get("target_layer_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= -1 for i in ids)
    ):
        raise ConfigError(
            f"target_layer_ids must be a non-empty list of layer ids (-1: the embedding output), got {ids!r}"
        )
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ConfigError(f"target_layer_ids must be strictly increasing, got {ids}")
    return tuple(ids)


def parse_dspark_config(raw: Mapping[str, Any]) -> DSparkConfig:
    """A DSpark draft's config.json as DeepSpec writes it: the target's text config with
    ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``,
    ``markov_rank`` / ``markov_head_type`` and ``enable_confidence_head`` /
    ``confidence_head_with_markov`` added (and mtp-jax's ``confidence_temperatures`` and
    ``confidence_shifts``)."""
    if not is_dspark_config(raw):
        raise ConfigError(f"not a DSpark draft config (architectures {raw.get('architectures')!r})")
    if raw.get("model_type") == "gemma4" or any("gemma" in str(a).lower() for a in raw["architectures"]):
        raise ConfigError("Gemma-4 DSpark drafts are not supported (their layers are Gemma 4's); Qwen3's are")
    if get_field(raw, "tie_word_embeddings", bool, False):
        raise ConfigError("tie_word_embeddings=true: a DSpark draft stores its frozen head apart (false)")
    types = raw.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ConfigError(f"layer_types {types!r}: DSpark draft layers attend fully ('full_attention')")
    if "mask_token_id" not in raw:
        raise ConfigError(
            "a DSpark draft needs mask_token_id (the id its block's slots after the anchor hold)"
        )
    mask = get_field(raw, "mask_token_id", int)
    backbone_raw = {k: v for k, v in raw.items() if k not in ("dflash_config", "target_layer_ids")}
    backbone = parse_dflash_config({**backbone_raw, "dflash_config": {"mask_token_id": mask}})
    ids = _layer_ids(raw)
    rank = get_field(raw, "markov_rank", int, 0)
    if rank < 0:
        raise ConfigError(f"markov_rank must be 0 (no sequential head) or positive, got {rank}")
    head = get_field(raw, "markov_head_type", str, "vanilla")
    if head not in HEAD_TYPES:
        raise ConfigError(f"markov_head_type {head!r} is not one of {', '.join(HEAD_TYPES)}")
    temps = _per_slot(
        raw, "confidence_temperatures", backbone.block_size, "positive numbers", lambda t: t > 0
    )
    shifts = _per_slot(raw, "confidence_shifts", backbone.block_size, "finite numbers", math.isfinite)
    n = get_field(raw, "num_target_layers", int, None)
    if n is not None and ids[-1] >= n - 1:
        raise ConfigError(
            f"target_layer_ids {list(ids)}: layer {ids[-1]} of {n} (the final layer is not allowed; ids "
            f"run from -1, the embedding output, to {n - 2})"
        )
    return DSparkConfig(
        backbone=backbone,
        target_layer_ids=ids,
        num_target_layers=n,
        markov_rank=rank,
        markov_head_type=head,
        confidence_head=get_field(raw, "enable_confidence_head", bool, False),
        confidence_with_markov=get_field(raw, "confidence_head_with_markov", bool, True),
        confidence_temperatures=temps,
        confidence_shifts=shifts,
        architecture=str(raw["architectures"][0]),
    )


def dspark_capture(cfg: DSparkConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers the draft reads, checked against a target of ``num_target_layers``."""
    n = num_target_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise ConfigError(
            f"the DSpark draft was made for a target of {cfg.num_target_layers} layers "
            f"(num_target_layers); this target has {n}"
        )
    for i in cfg.target_layer_ids:
        if not -1 <= i < n - 1:
            raise ConfigError(
                f"target_layer_ids {list(cfg.target_layer_ids)}: layer {i} is outside -1..{n - 2} for a "
                f"target of {n} layers (-1: the embedding output; the final layer is not allowed)"
            )
    return cfg.target_layer_ids


def parse_dspark_draft(
    raw: Mapping[str, Any], num_target_layers: int, options: Mapping[str, Any], target_vocab_size: int | None
) -> DSparkConfig | None:
    """The draft's :attr:`~mtp_jax.drafts.base.Draft.parse_config` hook."""
    if not is_dspark_config(raw):
        return None
    cfg = parse_dspark_config(raw)
    return dataclasses.replace(cfg, capture=dspark_capture(cfg, num_target_layers))


def _per_slot(raw: Mapping[str, Any], name: str, block_size: int, what: str, ok) -> tuple[float, ...] | None:
    """``raw[name]``: None, or one number per block slot each passing ``ok`` (ConfigError naming it)."""
    values = raw.get(name)
    if values is None:
        return None
    if (
        not isinstance(values, list)
        or len(values) != block_size
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v) for v in values)
    ):
        raise ConfigError(f"{name} must be {block_size} {what} (one per block slot), got {values!r}")
    return tuple(float(v) for v in values)
