"""Training a DFlash block-diffusion draft against a frozen target (``scripts/train_dflash.py``
runs it; DSpark builds on it): the draft's config.json for a target, its initial weights, and
DFlash's objective as SpecForge trains it: random anchored blocks per window, each seeing the
context strictly before its anchor and itself bidirectionally, block row j's soft cross-entropy
against the target's own distribution for the token at anchor + j, weighted exp(-(j-1)/gamma)."""

from __future__ import annotations

import math
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.checkpoint.safetensors_io import CheckpointReader, write_hub_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.drafts.dflash.checkpoint import load_dflash
from mtp_jax.drafts.dflash.config import DFlashConfig, parse_dflash_config
from mtp_jax.drafts.dflash.draft import block_forward, context_rows, dflash_features
from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
from mtp_jax.drafts.teacher import dense_teacher, top_k_teacher
from mtp_jax.targets import target_for
from mtp_jax.targets.base import head_logits, lm_head

PAD = 2  # <|pad|> of the embedded models' tokenizer: the mask token


def draft_config(
    target: dict, cfg: ModelConfig, layers: int, layer_ids: list[int], block: int, mask: int = PAD
) -> dict:
    """The draft's config.json: ``layers`` Qwen3-style layers at the target's width (GQA like a
    Llama target's attention; for a DeepSeek-V3 target, its head count and an even split)."""
    heads = target["num_attention_heads"]
    kv = target.get("num_key_value_heads", heads)
    if target["model_type"] != "llama":
        kv = max(1, heads // 2)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": cfg.hidden_size // heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,  # the global base (Gemma: also spelled in rope_parameters)
        "rope_scaling": target.get("rope_scaling") if target["model_type"] == "llama" else None,
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_hidden_layers,
        "block_size": block,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layer_ids},
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }


def init_draft(
    raw: dict, cfg: ModelConfig, seed: int, params: dict | None = None, ids: np.ndarray | None = None
) -> tuple[DFlashConfig, dict]:
    """N(0, 0.02) projections (output projections / sqrt(2 n)), unit norms, built in the hub layout
    and read back by the loader (with a draft vocabulary ``ids``: its ``d2t``, the head's columns
    from the target's ``params``)."""
    dcfg = parse_dflash_config(raw)
    n = len(raw["dflash_config"]["target_layer_ids"])
    tensors = dflash_hub_tensors(dcfg, n, seed, 0.02, draft_ids=ids)
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] / math.sqrt(2.0 * dcfg.num_hidden_layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, raw, tensors)
        reader = CheckpointReader(path)
        return load_dflash(reader, raw, cfg, jnp.float32, strict=True, verbose=False, target_params=params)


FIXED = ("draft_to_target", "lm_head")  # a draft vocabulary's ids and the target head's columns: not trained


def anchors_for(seed: int, step: int, batch: int, count: int, length: int, block: int) -> np.ndarray:
    """[batch, count] anchor positions in 0..length-block, drawn from (seed, step): resumable."""
    rng = np.random.default_rng([seed, step, 2])
    return np.sort(rng.integers(0, length - block + 1, (batch, count)), axis=1).astype(np.int32)


def draft_losses(
    tree: dict,
    params: dict,
    cfg: ModelConfig,
    dcfg: DFlashConfig,
    window: jax.Array,
    anchors: jax.Array,
    gamma: float,
    cached: dict | None = None,
) -> tuple[jax.Array, dict]:
    """Windows [b, s] with anchors [b, n]: the frozen target's features and distributions, then the
    n blocks per window in one forward (each over the context before its anchor). Block row j's soft
    cross-entropy is against the target's distribution for the token at anchor + j (restricted to
    the draft vocabulary ``tree["draft_to_target"]`` when there is one); ``agreement``: the draft's
    argmax (as a target id) equals the target's greedy token there.

    ``cached``: the target's rows for the window's first s - 1 tokens from a target cache
    (features [b, s-1, F], top_ids / top_logp [b, s-1, k]) instead of running the target."""
    inputs = window[:, :-1]
    ids = tree.get("draft_to_target")
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if cached is None:
        hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
        features = jax.lax.stop_gradient(dflash_features(dcfg, cfg.num_hidden_layers, hidden))
        logits = jax.lax.stop_gradient(lm_head(params, hidden.post_norm))  # row r predicts token r+1
    else:
        features = cached["features"]
    full = {**params, "dflash": tree}
    bs = dcfg.block_size
    offsets = jnp.arange(bs, dtype=jnp.int32)
    block_pos = anchors[:, :, None] + offsets  # [b, n, bs]
    blocks = jnp.full(block_pos.shape, dcfg.mask_token_id, window.dtype)
    blocks = blocks.at[:, :, 0].set(jnp.take_along_axis(inputs, anchors, axis=1))
    visible = positions[:, None, :] < anchors[:, :, None]  # [b, n, t]: context strictly before
    normed = block_forward(
        full, dcfg, blocks, block_pos, context_rows(full, dcfg, features), positions, visible
    )
    rows = (block_pos[:, :, 1:] - 1).reshape(b, -1)  # target logits row predicting each block row
    shape = block_pos[:, :, 1:].shape
    if cached is None:
        picked = jnp.take_along_axis(logits, rows[..., None], axis=1).reshape(*shape, -1)
        teacher = dense_teacher(picked, ids)
    else:
        top = [jnp.take_along_axis(cached[k], rows[..., None], axis=1) for k in ("top_ids", "top_logp")]
        teacher = top_k_teacher(*(x.reshape(*shape, -1) for x in top), ids, cfg.vocab_size)
    if ids is None:
        logp = jax.nn.log_softmax(lm_head(full, normed[:, :, 1:]), axis=-1)
        chosen = jnp.argmax(logp, -1)
    else:  # over the draft vocabulary (draft ids), argmax mapped back to target ids
        logp = jax.nn.log_softmax(head_logits(tree["lm_head"], normed[:, :, 1:]), axis=-1)
        chosen = ids[jnp.argmax(logp, -1)]
    per_row = -(teacher["probs"] * logp).sum(-1).mean((0, 1))  # [bs - 1]
    agree = (chosen == teacher["greedy"]).mean((0, 1))
    weights = np.exp(-np.arange(bs - 1) / gamma)
    total = (per_row * (weights / weights.sum())).sum()
    aux = {"loss": total, "level_loss": per_row, "level_agreement": agree}
    if ids is not None:
        aux["coverage"] = teacher["covered"].mean()
    return total, aux


def held_out_means(
    aux_of, stream: np.ndarray, length: int, count: int, anchors: int, block: int
) -> dict[str, list | float]:
    """Mean held-out numbers (``aux_of(windows, anchors)``: a draft's loss aux) over ``count`` fixed,
    evenly spaced windows of ``length`` tokens, each with ``anchors`` fixed anchors."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + length] for s in starts])
    totals: dict[str, np.ndarray] = {}
    for i in range(0, count, 8):
        w = windows[i : i + 8]
        a = anchors_for(0, i, len(w), anchors, length - 1, block)
        aux = aux_of(jnp.asarray(w), jnp.asarray(a))
        for key, value in aux.items():
            totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64) * len(w)
    return {k: (v / count).tolist() for k, v in totals.items()}


def evaluate(
    tree, params, cfg, dcfg, stream: np.ndarray, length: int, count: int, anchors: int, gamma: float
) -> dict:
    """Mean held-out numbers over ``count`` fixed, evenly spaced windows with fixed anchors."""
    fn = jax.jit(lambda t, w, a, p: draft_losses(t, p, cfg, dcfg, w, a, gamma)[1])
    block = dcfg.block_size
    return held_out_means(lambda w, a: fn(tree, w, a, params), stream, length, count, anchors, block)
