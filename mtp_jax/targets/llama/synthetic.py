"""Random Llama-family checkpoints in the exact hub layout (tests and benchmarks)."""

from __future__ import annotations

import numpy as np

from mtp_jax.targets.llama.config import Llama3Config
from mtp_jax.targets.llama.model import target_layer_leaves


def llama_hub_tensors(
    cfg: Llama3Config, seed: int = 0, std: float = 0.1, embed_std: float = 1.0
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 Llama-family hub checkpoint (Llama 3, Qwen2, Qwen3: the layer
    tensors :func:`mtp_jax.targets.llama.model.layer_leaves` declares; no ``lm_head.weight`` when tied),
    drawn from a seeded normal (the embedding with ``embed_std``, projections and biases with
    ``std``); norms near 1."""
    rng = np.random.default_rng(seed)
    d, v = cfg.hidden_size, cfg.vocab_size

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": (rng.standard_normal((v, d)) * embed_std).astype(np.float32)}
    leaves = target_layer_leaves(cfg)
    for i in range(cfg.num_hidden_layers):
        for leaf in leaves:  # declared in hub order
            draw = norm if leaf.kind == "norm" else w
            tensors[f"model.layers.{i}.{leaf.hub}"] = draw(*leaf.hub_shape)
    tensors["model.norm.weight"] = norm(d)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = w(v, d)
    return tensors
