"""EAGLE-3 drafts' configuration: the published key layouts' config.json fields, GQA or MLA
attention, and which target layers the fusion layer reads (the three layer-id conventions).
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
from mtp_jax.drafts.dflash.config import is_dflash_config
from mtp_jax.drafts.draft_model.config import is_plain_lm
from mtp_jax.errors import ConfigError
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config, mla_widths, parse_yarn_rope
from mtp_jax.targets.llama.config import parse_llama_rope

EAGLE3_LAYER_READINGS = ("inputs", "outputs")

# Variant flags of published EAGLE-3 drafts: those whose math we implement, and those refused by name.
EAGLE3_FLAGS = ("norm_before_residual", "norm_output")
EAGLE3_REFUSED_FLAGS = ("norm_before_fc", "fc_norm")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft (one Llama-style decoder layer over three fused target hidden states).

    ``aux_layer_ids``: the captured-layer ids written in its config (None: the default), as
    written; ``capture`` is what they mean for a particular target, resolved at load
    (:func:`eagle3_capture`): target layer outputs, -1 for the embedding.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    mla: DeepseekV3Config | None = None
    """For an MLA draft: its attention's config (a one-layer dense DeepSeek-V3 config: the MLA
    widths, rope and YaRN scaling); None for a GQA draft."""
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_output: bool = False
    capture: tuple[int, ...] = ()

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Eagle3Config:
        return parse_eagle3_config(raw)


def parse_eagle3_config(raw: Mapping[str, Any], mla: bool = False) -> Eagle3Config:
    """An EAGLE-3 draft's config.json (any of the published spellings; docs/formats.md, "EAGLE-3 drafts").
    ``mla``: the draft's attention is DeepSeek's MLA (its checkpoint has ``q_a_proj`` /
    ``kv_a_proj_with_mqa``), described by the DeepSeek fields (``kv_lora_rank``, ...) and a YaRN
    ``rope_scaling``; otherwise Llama-style GQA with the llama3 scaling or none."""
    layers = positive_field(raw, "num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"num_hidden_layers={layers}: an EAGLE-3 draft has exactly one decoder layer")
    check_draft_layers(raw, "EAGLE-3")
    for flag in EAGLE3_REFUSED_FLAGS:
        if get_field(raw, flag, bool, False):
            raise ConfigError(
                f"{flag}=true is not supported for EAGLE-3 drafts (supported variant flags: "
                f"{', '.join(EAGLE3_FLAGS)})"
            )
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise ConfigError(f"config field 'eagle_config' must be an object, got {eagle!r}")
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ConfigError(
            "eagle_config.use_aux_hidden_state=false describes an EAGLE-1/2 draft (one hidden state), "
            "not EAGLE-3"
        )
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    check_layer_ids(ids, "eagle_aux_hidden_state_layer_ids")
    heads = positive_field(raw, "num_attention_heads")
    hidden = positive_field(raw, "hidden_size")
    # MLA attention is described by DeepSeek's fields; the GQA ones then mean nothing
    kv_heads, head_dim = (heads, 2) if mla else gqa_heads(raw, hidden, heads)
    vocab = positive_field(raw, "vocab_size")
    draft_vocab = positive_field(raw, "draft_vocab_size", vocab)
    if draft_vocab > vocab:
        raise ConfigError(f"draft_vocab_size ({draft_vocab}) exceeds vocab_size ({vocab})")
    theta, scaling = rope_settings(raw)
    cfg = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=positive_field(raw, "intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=positive_field(raw, "target_hidden_size", hidden),
        rms_norm_eps=get_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=positive_field(raw, "max_position_embeddings", 2048),
        rope_scaling=None if mla else parse_llama_rope(scaling),
        mla=_eagle3_mla(raw, hidden, heads) if mla else None,
        aux_layer_ids=None if ids is None else tuple(ids),
        **{flag: get_field(raw, flag, bool, False) for flag in EAGLE3_FLAGS},
    )
    if cfg.rms_norm_eps <= 0 or cfg.rope_theta <= 0:
        raise ConfigError(
            f"rms_norm_eps and rope_theta must be positive, got {cfg.rms_norm_eps} and {cfg.rope_theta}"
        )
    return cfg


def _eagle3_mla(raw: Mapping[str, Any], hidden: int, heads: int) -> DeepseekV3Config:
    """The attention config of an MLA EAGLE-3 draft: one dense DeepSeek-V3 layer (no experts)."""
    inter = positive_field(raw, "intermediate_size")
    return DeepseekV3Config(
        vocab_size=positive_field(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=inter,
        moe_intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        **mla_widths(raw),
        n_routed_experts=1,
        n_shared_experts=0,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rms_norm_eps=get_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=get_field(raw, "rope_theta", float, 10000.0),
        max_position_embeddings=positive_field(raw, "max_position_embeddings", 2048),
        rope_scaling=parse_yarn_rope(raw),
    )


def eagle3_capture(cfg: Eagle3Config, num_target_layers: int, layer_ids: str = "inputs") -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft reads, as target layer OUTPUTS (-1: the embedding).

    ``layer_ids="inputs"`` reads a config id i as the input of decoder layer i (vLLM and MAX;
    transformers' ``hidden_states[i]``), ``"outputs"`` as the output of layer i (SGLang; what
    SpecForge writes). Without ids: the inputs of layers 2, L/2 and L-3 (EAGLE-3's default)."""
    if layer_ids not in EAGLE3_LAYER_READINGS:
        raise ValueError(f"layer_ids must be one of {EAGLE3_LAYER_READINGS}, got {layer_ids!r}")
    n = num_target_layers
    if cfg.aux_layer_ids is None:
        return tuple(max(i, 0) - 1 for i in (2, n // 2, n - 3))
    shift = 1 if layer_ids == "inputs" else 0
    for i in cfg.aux_layer_ids:
        if not 0 <= i < n:
            raise ConfigError(
                f"eagle_aux_hidden_state_layer_ids {list(cfg.aux_layer_ids)}: id {i} is beyond the "
                f"target's {n} layers (ids read as layer {layer_ids}: 0..{n - 1})"
            )
    return tuple(i - shift for i in cfg.aux_layer_ids)


def parse_eagle3_draft(
    raw: Mapping[str, Any], num_target_layers: int, options: Mapping[str, Any], target_vocab_size: int | None
) -> Eagle3Config | None:
    """The draft's :attr:`~mtp_jax.drafts.base.Draft.parse_config` hook: every separately stored
    draft config that is neither DFlash's nor a plain causal LM's is read as EAGLE-3 (MLA attention
    when it carries ``kv_lora_rank``), its fields then checked, as the loader does without tensors."""
    if is_dflash_config(raw) or is_plain_lm(raw):
        return None
    layer_ids = check_load_options(options)
    cfg = parse_eagle3_config(raw, mla="kv_lora_rank" in raw)
    return dataclasses.replace(cfg, capture=eagle3_capture(cfg, num_target_layers, layer_ids))


def check_load_options(options: Mapping[str, Any]) -> str:
    """An EAGLE-3 draft's load options checked: ``layer_ids`` (how its config's captured-layer ids
    are read, one of :data:`EAGLE3_LAYER_READINGS`; default "inputs"), nothing else."""
    unknown = sorted(set(options) - {"layer_ids"})
    if unknown:
        raise ValueError(f"EAGLE-3 drafts take the load option layer_ids only, got {unknown}")
    layer_ids = options.get("layer_ids", "inputs")
    if layer_ids not in EAGLE3_LAYER_READINGS:
        raise ValueError(f"draft_layer_ids must be one of {EAGLE3_LAYER_READINGS}, got {layer_ids!r}")
    return layer_ids
