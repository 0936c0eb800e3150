"""Random DeepSeek-V3 checkpoints in the exact hub layout (tests, ``mtp-jax plan``, benchmarks), and
an oracle MTP draft whose acceptance is known."""

from __future__ import annotations

import numpy as np

from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.model import iter_hub, layer_leaves, mtp_leaves


def layer_tensors(
    cfg: DeepseekV3Config, i: int, rng: np.random.Generator, std: float
) -> dict[str, np.ndarray]:
    """Decoder layer ``i``'s hub tensors (as :func:`mtp_jax.targets.deepseek_v3.model.layer_leaves`
    declares them), drawn in hub order: projections and routers N(0, std), norms 1 + N(0, 0.1),
    correction biases N(0, 0.1)."""
    return _draw(f"model.layers.{i}.", layer_leaves(cfg, moe=i >= cfg.first_k_dense_replace), rng, std)


def _draw(pre: str, leaves: tuple, rng: np.random.Generator, std: float) -> dict[str, np.ndarray]:
    t = {}
    for leaf, j in iter_hub(leaves):
        if leaf.kind == "norm":
            x = 1.0 + 0.1 * rng.standard_normal(leaf.hub_shape)
        elif leaf.kind == "bias":
            x = 0.1 * rng.standard_normal(leaf.hub_shape)
        else:
            x = rng.standard_normal(leaf.hub_shape) * std
        t[pre + leaf.hub.format(e=j)] = x.astype(np.float32)
    return t


def hub_tensors(cfg: DeepseekV3Config, seed: int = 0, std: float = 0.1) -> dict[str, np.ndarray]:
    """Every tensor of a float32 DeepSeek-V3 hub checkpoint, drawn from a seeded normal."""
    rng = np.random.default_rng(seed)
    d, v = cfg.hidden_size, cfg.vocab_size
    tensors = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
    for i in range(cfg.num_hidden_layers):
        tensors.update(layer_tensors(cfg, i, rng, std))
    tensors["model.norm.weight"] = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = (rng.standard_normal((v, d)) * std).astype(np.float32)
    for k in range(cfg.num_nextn_predict_layers):
        n = cfg.num_hidden_layers + k
        pre = f"model.layers.{n}."
        mtp = layer_tensors(cfg, max(n, cfg.first_k_dense_replace), rng, std)
        tensors.update(
            {
                k2.replace(f"model.layers.{max(n, cfg.first_k_dense_replace)}.", pre): x
                for k2, x in mtp.items()
            }
        )
        tensors.update(_draw(pre, mtp_leaves(cfg), rng, std))
        tensors[f"{pre}shared_head.head.weight"] = tensors.get(
            "lm_head.weight", tensors["model.embed_tokens.weight"]
        )
        tensors[f"{pre}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def oracle_draft_tensors(cfg: DeepseekV3Config, alpha: float, seed: int = 0) -> dict[str, np.ndarray]:
    """Hub tensors whose MTP layer nearly predicts the target: a draft that gets accepted.

    The target's attention and MLP outputs are scaled by ``alpha`` (0: the target is a bigram model,
    logits = head(norm(embed(t)))). The MTP layer passes the next token's embedding straight
    through (eh_proj = [I, 0], its own attention and MLP zeroed, enorm = 1, shared_head.norm = the
    final norm), so it predicts that bigram exactly; with alpha > 0 the target drifts from it and
    only some drafts are accepted. For tests and benchmarks of the speculative machinery where
    random weights would accept nothing; it says nothing about real draft quality.
    """
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("an oracle draft needs num_nextn_predict_layers >= 1")
    tensors = hub_tensors(cfg, seed=seed)
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    for key in list(tensors):
        if key.startswith("model.layers.") and key.endswith(("o_proj.weight", "down_proj.weight")):
            layer = int(key.split(".")[2])
            tensors[key] = tensors[key] * (alpha if layer < n else 0.0)
    tensors[f"model.layers.{n}.eh_proj.weight"] = np.concatenate([np.eye(d), np.zeros((d, d))], 1).astype(
        np.float32
    )
    tensors[f"model.layers.{n}.enorm.weight"] = np.ones(d, np.float32)
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = tensors["model.norm.weight"].copy()
    return tensors
