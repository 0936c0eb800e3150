"""Random EAGLE-3 drafts in the published hub layout (GQA or MLA attention)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mtp_jax.checkpoint.hub_layout import vocab_map_tensors
from mtp_jax.drafts.eagle3.config import Eagle3Config


def _eagle3_attention(cfg: Eagle3Config, pre: str, w: Any, norm: Any) -> dict[str, np.ndarray]:
    """The draft layer's attention tensors (GQA, or MLA with ``cfg.mla``), drawn in key order."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    a = f"{pre}self_attn."
    if cfg.mla is None:
        attn = {
            f"{a}q_proj.weight": w(nh * hd, 2 * h),
            f"{a}k_proj.weight": w(nkv * hd, 2 * h),
            f"{a}v_proj.weight": w(nkv * hd, 2 * h),
            f"{a}o_proj.weight": w(h, nh * hd),
        }
    else:  # DeepSeek's MLA on a 2H input
        m = cfg.mla
        qk, kv, rope = m.qk_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
        attn = {
            f"{a}kv_a_proj_with_mqa.weight": w(kv + rope, 2 * h),
            f"{a}kv_a_layernorm.weight": norm(kv),
            f"{a}kv_b_proj.weight": w(nh * (m.qk_nope_head_dim + m.v_head_dim), kv),
            f"{a}o_proj.weight": w(h, nh * m.v_head_dim),
        }
        if m.q_lora_rank is None:
            attn[f"{a}q_proj.weight"] = w(nh * qk, 2 * h)
        else:
            attn[f"{a}q_a_proj.weight"] = w(m.q_lora_rank, 2 * h)
            attn[f"{a}q_a_layernorm.weight"] = norm(m.q_lora_rank)
            attn[f"{a}q_b_proj.weight"] = w(nh * qk, m.q_lora_rank)
    return attn


def eagle3_hub_tensors(
    cfg: Eagle3Config,
    seed: int = 0,
    std: float = 0.1,
    *,
    layer_prefix: str = "midlayer.",
    draft_ids: np.ndarray | None = None,
    embed: np.ndarray | None = None,
    n_features: int = 3,
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 EAGLE-3 draft in the published layout of ``layer_prefix``
    ("midlayer.", "layers.0." or NeMo's "model.layers.0.", which also prefixes fc, embed_tokens and
    norm with "model."); MLA attention tensors when ``cfg.mla`` is set. ``draft_ids``: the target
    ids of the draft vocabulary (ascending), stored as ``d2t`` offsets and a ``t2d`` mask;
    ``embed``: an ``embed_tokens.weight`` to include."""
    rng = np.random.default_rng(seed)
    h, f = cfg.hidden_size, cfg.intermediate_size
    top = "model." if layer_prefix.startswith("model.") else ""

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    pre = layer_prefix
    tensors = {
        f"{top}fc.weight": w(h, n_features * cfg.target_hidden_size),
        f"{pre}hidden_norm.weight": norm(h),
        f"{pre}input_layernorm.weight": norm(h),
        **_eagle3_attention(cfg, pre, w, norm),
        f"{pre}post_attention_layernorm.weight": norm(h),
        f"{pre}mlp.gate_proj.weight": w(f, h),
        f"{pre}mlp.up_proj.weight": w(f, h),
        f"{pre}mlp.down_proj.weight": w(h, f),
        f"{top}norm.weight": norm(h),
        "lm_head.weight": w(cfg.draft_vocab_size, h),
    }
    if draft_ids is not None:
        tensors.update(vocab_map_tensors(draft_ids, cfg.vocab_size))
    if embed is not None:
        tensors[f"{top}embed_tokens.weight"] = np.asarray(embed, np.float32)
    return tensors
