"""Training an EAGLE-3 draft against a frozen target (``scripts/train_eagle3.py`` runs it): the
draft's config.json for a target (its attention the target's kind), its initial weights, and the
objective, EAGLE-3's "training-time test": the draft unrolled ``depth`` chained steps over whole
windows as speculative decoding chains it, each step's soft cross-entropy against the target's own
next-token distribution over the draft vocabulary, step j weighted ``decay``^(j-1)."""

from __future__ import annotations

import math
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.checkpoint.safetensors_io import CheckpointReader, write_hub_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.drafts.eagle3.checkpoint import load_eagle3
from mtp_jax.drafts.eagle3.config import Eagle3Config, parse_eagle3_config
from mtp_jax.drafts.eagle3.draft import draft_vocab_logits, eagle3_chain_teacher_forced, fused_features
from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors
from mtp_jax.drafts.teacher import dense_teacher, top_k_teacher
from mtp_jax.targets import target_for
from mtp_jax.targets.base import lm_head
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config

LAYER_PREFIX = "layers.0."


def spread_layer_ids(num_layers: int) -> list[int]:
    """Three distinct captured layers, low / mid / high, as layer INPUT ids (vLLM's reading): the
    usual (2, L/2, L-3) when those are distinct, else evenly spread over 1..L-1."""
    usual = [2, num_layers // 2, num_layers - 3]
    if len(set(usual)) == 3 and all(0 <= i < num_layers for i in usual):
        return usual
    return [int(round(x)) for x in np.linspace(1, num_layers - 1, 3)]


def draft_config(target: dict, cfg: ModelConfig, attention: str, layer_ids: list[int], vocab: int) -> dict:
    """The draft's config.json: one layer of the target's own width and attention kind."""
    common = {
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_theta": cfg.rope_theta,  # the global base (Gemma: also spelled in rope_parameters)
        "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }
    if attention == "mla":
        if not isinstance(cfg, DeepseekV3Config):
            raise SystemExit("--attention mla needs a DeepSeek-V3 target (its MLA widths are copied)")
        mla = {k: target[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")}
        return {
            "architectures": ["Eagle3DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v3",
            **common,
            **mla,
            "v_head_dim": target["v_head_dim"],
            "num_attention_heads": target["num_attention_heads"],
            "num_key_value_heads": target["num_attention_heads"],
            "intermediate_size": target["intermediate_size"],
            "rope_scaling": target.get("rope_scaling"),
        }
    heads = target["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **common,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target.get("head_dim", cfg.hidden_size // heads),
        "intermediate_size": target["intermediate_size"],
        "rope_scaling": target.get("rope_scaling") if target["model_type"] == "llama" else None,
    }


def init_draft(
    raw: dict, cfg: ModelConfig, params: dict, ids: np.ndarray, seed: int
) -> tuple[Eagle3Config, dict]:
    """Initial draft: N(0, 0.02) projections (output projections scaled by 1/sqrt(2)), unit norms,
    the head as the target's head rows of the draft vocabulary and the final norm as the target's;
    built in the hub layout and read back by the loader (so the tree is exactly a loaded one's)."""
    dcfg = parse_eagle3_config(raw, mla=raw["architectures"][0].startswith("Eagle3Deepseek"))
    tensors = eagle3_hub_tensors(dcfg, seed, 0.02, layer_prefix=LAYER_PREFIX, draft_ids=ids)
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] / math.sqrt(2.0)
    head = np.asarray(lm_head(params, jnp.eye(cfg.hidden_size)))  # [d, V] whether tied or not
    tensors["lm_head.weight"] = np.ascontiguousarray(head[:, ids].T)
    # the target's final norm as a plain RMSNorm weight (Gemma stores w for a 1 + w factor)
    tensors["norm.weight"] = np.asarray(target_for(cfg).norm_scale(params["final_norm"]), np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, raw, tensors)
        return load_eagle3(CheckpointReader(path), raw, cfg, params, jnp.float32, strict=True, verbose=False)


def draft_losses(
    tree: dict,
    params: dict,
    cfg: ModelConfig,
    dcfg: Eagle3Config,
    window: jax.Array,
    depth: int,
    decay: float,
    cached: dict | None = None,
) -> tuple[jax.Array, dict]:
    """Windows [b, s]: the frozen target's features and distributions, then the draft's ``depth``
    chained steps (:func:`eagle3_chain_teacher_forced`). Step j's soft cross-entropy is against the
    target's distribution for token i+j+1 restricted to the draft vocabulary; ``agreement``: the
    draft's argmax (as a target id) equals the target's greedy token there (step 1: the K = 1
    acceptance rate at temperature 0; step j: draft j's, given true earlier tokens).

    ``cached``: the target's rows for the window's first s - 1 tokens from a target cache
    (features [b, s-1, F], top_ids / top_logp [b, s-1, k]) instead of running the target."""
    ids = tree["draft_to_target"]
    if cached is None:
        inputs = window[:, :-1]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
        feats = jax.lax.stop_gradient(fused_features(hidden.layers))
        logits = jax.lax.stop_gradient(lm_head(params, hidden.post_norm))  # row r predicts token r+1
        teacher = dense_teacher(logits, ids)
    else:
        feats = cached["features"]
        teacher = top_k_teacher(cached["top_ids"], cached["top_logp"], ids, cfg.vocab_size)
    full = {**params, "eagle3": tree}
    levels = eagle3_chain_teacher_forced(full, dcfg, window, feats, depth)
    n = levels[0].shape[1]
    losses, agree = [], []
    for j, normed in enumerate(levels, start=1):
        logp = jax.nn.log_softmax(draft_vocab_logits(full, normed), axis=-1)
        losses.append(-(teacher["probs"][:, j : j + n] * logp).sum(-1).mean())
        agree.append((ids[jnp.argmax(logp, -1)] == teacher["greedy"][:, j : j + n]).mean())
    weights = decay ** np.arange(depth) / np.sum(decay ** np.arange(depth))
    total = sum(float(w) * loss for w, loss in zip(weights, losses, strict=True))
    coverage = teacher["covered"][:, 1 : 1 + n].mean()
    return total, {
        "loss": total,
        "level_loss": jnp.stack(losses),
        "level_agreement": jnp.stack(agree),
        "coverage": coverage,
    }


def evaluate(
    tree, params, cfg, dcfg, stream: np.ndarray, length: int, count: int, depth: int, decay: float
) -> dict:
    """Mean held-out numbers over ``count`` fixed, evenly spaced windows."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + length] for s in starts])
    fn = jax.jit(lambda t, w, p: draft_losses(t, p, cfg, dcfg, w, depth, decay)[1])
    totals: dict[str, np.ndarray] = {}
    for i in range(0, count, 8):
        aux = fn(tree, jnp.asarray(windows[i : i + 8]), params)
        for key, value in aux.items():
            totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64) * len(windows[i : i + 8])
    return {k: (v / count).tolist() for k, v in totals.items()}
