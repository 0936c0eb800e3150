"""Random Gemma 3 checkpoints in the exact hub layout (tests and benchmarks)."""

from __future__ import annotations

import numpy as np

from mtp_jax.targets.gemma3.config import Gemma3Config
from mtp_jax.targets.gemma3.model import target_layer_leaves


def gemma3_hub_tensors(
    cfg: Gemma3Config, seed: int = 0, std: float = 0.1, embed_std: float = 1.0
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 ``Gemma3ForCausalLM`` checkpoint (no ``lm_head.weight`` when tied),
    drawn from a seeded normal (the embedding with ``embed_std``, projections with ``std``); norm
    weights near 0 (their gain is 1 + w)."""
    rng = np.random.default_rng(seed)
    d, v = cfg.hidden_size, cfg.vocab_size

    def draw(scale: float, shape: tuple[int, ...]) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": draw(embed_std, (v, d))}
    leaves = target_layer_leaves(cfg)
    for i in range(cfg.num_hidden_layers):
        for leaf in leaves:
            tensors[f"model.layers.{i}.{leaf.hub}"] = draw(
                0.1 if leaf.kind == "norm" else std, leaf.hub_shape
            )
    tensors["model.norm.weight"] = draw(0.1, (d,))
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = draw(std, (v, d))
    return tensors
