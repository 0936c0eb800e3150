"""Random DFlash drafts in the published hub layout."""

from __future__ import annotations

import numpy as np

from mtp_jax.checkpoint.hub_layout import vocab_map_tensors
from mtp_jax.drafts.dflash.config import DFlashConfig


def dflash_hub_tensors(
    cfg: DFlashConfig,
    n_features: int,
    seed: int = 0,
    std: float = 0.1,
    draft_ids: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 DFlash draft in the published layout (no ``model.`` prefix):
    ``fc`` over ``n_features`` target layers, ``hidden_norm``, ``norm`` and ``layers.{i}.*`` with
    Qwen3's ``q_norm`` / ``k_norm``; no embedding and no head. ``draft_ids``: the target ids of a
    draft vocabulary (``d2t``, and ``t2d`` when ``cfg.vocab_size`` is set)."""
    rng = np.random.default_rng(seed)
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"fc.weight": w(h, n_features * h), "hidden_norm.weight": norm(h)}
    for i in range(cfg.num_hidden_layers):
        pre, a = f"layers.{i}.", f"layers.{i}.self_attn."
        tensors.update(
            {
                f"{pre}input_layernorm.weight": norm(h),
                f"{a}q_proj.weight": w(nh * hd, h),
                f"{a}k_proj.weight": w(nkv * hd, h),
                f"{a}v_proj.weight": w(nkv * hd, h),
                f"{a}o_proj.weight": w(h, nh * hd),
                f"{a}q_norm.weight": norm(hd),
                f"{a}k_norm.weight": norm(hd),
                f"{pre}post_attention_layernorm.weight": norm(h),
                f"{pre}mlp.gate_proj.weight": w(f, h),
                f"{pre}mlp.up_proj.weight": w(f, h),
                f"{pre}mlp.down_proj.weight": w(h, f),
            }
        )
    tensors["norm.weight"] = norm(h)
    if draft_ids is not None:
        tensors.update(vocab_map_tensors(draft_ids, cfg.vocab_size))
    return tensors
