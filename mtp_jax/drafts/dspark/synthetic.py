"""Random DSpark drafts in DeepSpec's layout (tests, random-weight timings)."""

from __future__ import annotations

import numpy as np

from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
from mtp_jax.drafts.dspark.config import DSparkConfig


def dspark_hub_tensors(
    cfg: DSparkConfig,
    embed: np.ndarray,
    head: np.ndarray,
    seed: int = 0,
    std: float = 0.1,
    head_std: float = 1.0,
    draft_ids: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 DSpark draft of ``cfg`` in DeepSpec's layout: the backbone (as
    :func:`~mtp_jax.drafts.dflash.synthetic.dflash_hub_tensors` draws it, ``fc`` over the config's
    ``target_layer_ids``), the frozen ``embed_tokens`` / ``lm_head`` [V, d] (the target's ``embed``
    and ``head``, given [V, d]), and the heads the config declares (``head_std``: the scale of the
    Markov bias's factors). ``draft_ids``: the target ids of a draft vocabulary (``d2t``, ``t2d``;
    the config's ``draft_vocab_size`` must say how many): W2 covers them only."""
    rng = np.random.default_rng(seed + 1000)
    d, r = cfg.hidden_size, cfg.markov_rank
    vocab = embed.shape[0]
    tensors = dflash_hub_tensors(
        cfg.backbone, len(cfg.target_layer_ids), seed=seed, std=std, draft_ids=draft_ids
    )
    draft_vocab = vocab if draft_ids is None else len(draft_ids)
    tensors["embed_tokens.weight"] = np.asarray(embed, np.float32)
    tensors["lm_head.weight"] = np.asarray(head, np.float32)

    def w(*shape: int, scale: float = std) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    if r > 0:
        tensors["markov_head.markov_w1.weight"] = w(vocab, r, scale=head_std)
        tensors["markov_head.markov_w2.weight"] = w(draft_vocab, r, scale=head_std / np.sqrt(r))
        if cfg.markov_head_type == "rnn":
            tensors["markov_head.joint_proj.weight"] = w(3 * r, 2 * r + d, scale=0.5)
            tensors["markov_head.joint_proj.bias"] = w(3 * r, scale=0.5)
        elif cfg.markov_head_type == "gated":
            tensors["markov_head.gate_proj.weight"] = w(r, d + r, scale=0.5)
            tensors["markov_head.gate_proj.bias"] = w(r, scale=0.5)
    if cfg.confidence_head:
        tensors["confidence_head.proj.weight"] = w(1, cfg.confidence_width, scale=0.3)
        tensors["confidence_head.proj.bias"] = w(1, scale=0.3)
    return tensors
