"""DFlash drafts' configuration: the block size, mask token, draft layers and the target layers
whose hidden states are injected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import (
    Llama3RopeScaling,
    check_draft_layers,
    check_layer_ids,
    get_field,
    gqa_heads,
    positive_field,
    rope_settings,
)
from mtp_jax.errors import ConfigError
from mtp_jax.targets.llama.config import parse_llama_rope


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash block-diffusion draft (docs/formats.md, "DFlash drafts"): ``num_hidden_layers``
    Qwen3-style decoder layers (q_norm / k_norm before rope) that propose a whole block in one
    non-causal forward, conditioned on the target's hidden states injected as extra keys and values;
    no embedding and no head of its own (the target's).

    ``target_layer_ids``: the captured target layers as written (layer OUTPUTS; None: the default);
    ``capture`` is what they mean for a particular target, resolved at load (:func:`dflash_capture`).
    ``draft_vocab_size`` (an mtp-jax extension, absent from the published layout): the block's head
    is the target's head restricted to that many target ids (the checkpoint's ``d2t`` offsets, as
    EAGLE-3 writes them); None: the target's whole vocabulary.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    rope_scaling: Llama3RopeScaling | None = None
    target_layer_ids: tuple[int, ...] | None = None
    num_target_layers: int | None = None
    vocab_size: int | None = None
    draft_vocab_size: int | None = None
    capture: tuple[int, ...] = ()

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DFlashConfig:
        return parse_dflash_config(raw)


def parse_dflash_config(raw: Mapping[str, Any]) -> DFlashConfig:
    """A DFlash draft's config.json: ``block_size`` at top level or inside ``dflash_config`` (newer
    checkpoints), ``dflash_config.mask_token_id`` (required) and ``target_layer_ids``, the
    draft's own rope (``llama3`` scaling or none)."""
    check_draft_layers(raw, "DFlash")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, Mapping):
        raise ConfigError(f"config field 'dflash_config' must be an object, got {dflash!r}")
    if "mask_token_id" not in dflash:
        raise ConfigError(
            "a DFlash draft needs dflash_config.mask_token_id (the id its block is masked with)"
        )
    mask = get_field(dflash, "mask_token_id", int)
    if mask < 0:
        raise ConfigError(f"dflash_config.mask_token_id must be a token id, got {mask}")
    sizes = {
        where: positive_field(src, "block_size", None) for where, src in (("top", raw), ("dflash", dflash))
    }
    if sizes["top"] and sizes["dflash"] and sizes["top"] != sizes["dflash"]:
        raise ConfigError(
            f"block_size {sizes['top']} (top level) and dflash_config.block_size {sizes['dflash']} disagree"
        )
    block = sizes["dflash"] or sizes["top"]
    if block is None:
        raise ConfigError("a DFlash draft needs block_size (top level or in dflash_config)")
    if block < 2:
        raise ConfigError(f"block_size must be at least 2 (an anchor and one draft), got {block}")
    ids = dflash.get("target_layer_ids")
    check_layer_ids(ids, "dflash_config.target_layer_ids")
    heads = positive_field(raw, "num_attention_heads")
    hidden = positive_field(raw, "hidden_size")
    kv_heads, head_dim = gqa_heads(raw, hidden, heads)
    theta, scaling = rope_settings(raw)
    cfg = DFlashConfig(
        hidden_size=hidden,
        intermediate_size=positive_field(raw, "intermediate_size"),
        num_hidden_layers=positive_field(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=positive_field(raw, "max_position_embeddings", 2048),
        block_size=block,
        mask_token_id=mask,
        rope_scaling=parse_llama_rope(scaling),
        target_layer_ids=None if ids is None else tuple(ids),
        num_target_layers=positive_field(raw, "num_target_layers", None),
        vocab_size=positive_field(raw, "vocab_size", None),
        draft_vocab_size=positive_field(raw, "draft_vocab_size", None),
    )
    if cfg.rms_norm_eps <= 0 or cfg.rope_theta <= 0:
        raise ConfigError(
            f"rms_norm_eps and rope_theta must be positive, got {cfg.rms_norm_eps} and {cfg.rope_theta}"
        )
    if cfg.vocab_size is not None and (cfg.draft_vocab_size or 0) > cfg.vocab_size:
        raise ConfigError(f"draft_vocab_size ({cfg.draft_vocab_size}) exceeds vocab_size ({cfg.vocab_size})")
    if cfg.vocab_size is not None and mask >= cfg.vocab_size:
        raise ConfigError(
            f"dflash_config.mask_token_id {mask} is outside the vocabulary (vocab_size {cfg.vocab_size})"
        )
    return cfg


def dflash_default_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's default captured layers (outputs): the middle one for a single layer, else
    ``round(1 + i·(L − 4)/(count − 1))`` for i = 0..count−1 (36 layers, 5 → 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (count - 1))) for i in range(count))


def dflash_capture(cfg: DFlashConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layer OUTPUTS a DFlash draft reads (transformers' ``hidden_states[i + 1]``): its
    ``target_layer_ids``, or without them the default for its ``num_target_layers`` and one layer
    per draft layer."""
    n = num_target_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise ConfigError(
            f"the DFlash draft was made for a target of {cfg.num_target_layers} layers "
            f"(num_target_layers); this target has {n}"
        )
    ids = cfg.target_layer_ids or dflash_default_layers(n, cfg.num_hidden_layers)
    for i in ids:
        if not 0 <= i < n:
            raise ConfigError(
                f"dflash_config.target_layer_ids {list(ids)}: layer {i} is beyond the target's {n} layers "
                f"(ids are layer outputs: 0..{n - 1})"
            )
    return tuple(ids)


def is_dflash_config(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json is a DFlash draft's: its architecture or its ``dflash_config``."""
    archs = " ".join(map(str, raw.get("architectures") or [])).lower()
    return "dflash" in archs or "dflash_config" in raw


def parse_dflash_draft(
    raw: Mapping[str, Any], num_target_layers: int, options: Mapping[str, Any], target_vocab_size: int | None
) -> DFlashConfig | None:
    """The draft's :attr:`~mtp_jax.drafts.base.Draft.parse_config` hook (``options`` and
    ``target_vocab_size`` do not apply: DFlash ids are always layer outputs)."""
    if not is_dflash_config(raw):
        return None
    cfg = parse_dflash_config(raw)
    return dataclasses.replace(cfg, capture=dflash_capture(cfg, num_target_layers))
