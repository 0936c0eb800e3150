"""The Llama family's GGUF files (llama.cpp architectures ``llama``, ``qwen2``, ``qwen3``): their
config from the metadata, llama.cpp's tensor names, and the query/key rows llama.cpp reorders.

``llama`` covers Llama 2/3 and relatives such as SmolLM2; ``qwen2`` and ``qwen3`` add q/k/v biases
and q/k norms. For ``llama`` llama.cpp's converter reorders the query and key rows of each head for
its interleaved rope; they are put back in the rotate-half order of hub checkpoints here (Qwen GGUFs
keep the hub order: llama.cpp runs them with rotate-half rope). Llama 3.1-3.3 files carry llama3 rope
scaling as a ``rope_freqs`` tensor, read back into the config's ``rope_scaling``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mtp_jax.checkpoint.gguf import GGUFCheckpoint, GGUFLayout
from mtp_jax.errors import ConfigError

HUB_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp tensor names -> hub names (per-layer ones under blk.{i}.).
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def hf_config(ckpt: GGUFCheckpoint) -> dict:
    """The Hugging Face config.json of a Llama-family GGUF, from its metadata."""
    heads = int(ckpt.meta("attention.head_count"))
    hidden = int(ckpt.meta("embedding_length"))
    head_dim = int(ckpt.meta("attention.key_length", hidden // heads if heads else 0))
    rope_dims = int(ckpt.meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConfigError(
            f"{ckpt.path}: rope over {rope_dims} of {head_dim} head dimensions (partial rope) is not "
            "supported"
        )
    tokens = ckpt.metadata.get("tokenizer.ggml.tokens")
    vocab = int(ckpt.meta("vocab_size", len(tokens) if tokens else 0))
    if ckpt.has_tensor("token_embd.weight"):
        vocab = ckpt.tensor_shape("token_embd.weight")[0]
    kv = ckpt.meta("attention.head_count_kv", heads)
    if isinstance(kv, list):
        raise ConfigError(f"{ckpt.path}: per-layer key/value head counts are not supported")
    raw: dict[str, Any] = {
        "architectures": [HUB_ARCHITECTURES[ckpt.architecture]],
        "model_type": ckpt.architecture,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(ckpt.meta("feed_forward_length")),
        "num_hidden_layers": int(ckpt.meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(ckpt.meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(ckpt.meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(ckpt.meta("context_length", 2048)),
        "tie_word_embeddings": not ckpt.has_tensor("output.weight"),
        "hidden_act": "silu",
    }
    for key, out in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if key in ckpt.metadata:
            raw[out] = int(ckpt.metadata[key])
    scaling = rope_scaling(ckpt, head_dim, raw["rope_theta"])
    if scaling is not None:
        raw["rope_scaling"] = scaling
    return raw


def rope_scaling(ckpt: GGUFCheckpoint, head_dim: int, theta: float) -> dict | None:
    """The config's ``rope_scaling`` of a GGUF: None without a ``rope_freqs`` tensor, else the
    llama3 scaling whose divisors it holds (a :class:`ConfigError` when none does)."""
    kind = ckpt.meta("rope.scaling.type", None)
    if kind not in (None, "none"):
        raise ConfigError(f"{ckpt.path}: rope scaling {kind!r} is not supported for GGUF Llama models")
    if not ckpt.has_tensor("rope_freqs.weight"):
        return None
    # Llama 3.1-3.3 GGUFs carry llama3 rope scaling as per-frequency divisors (rope_freqs); find
    # the parameters that produce them (the published low 1 / high 4, the original context
    # solved from a divisor between the two limits, or a power of two), or refuse.
    freqs = ckpt.array("rope_freqs.weight").astype(np.float64)
    factor, low, high = float(freqs.max()), 1.0, 4.0
    candidates = {2**k for k in range(6, 18)}
    if factor > 1:
        inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        for f, w in zip(freqs, 2 * math.pi / inv, strict=False):
            if 1 < f < factor:
                smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
                candidates.add(round(w * (smooth * (high - low) + low)))
    for original in sorted(candidates):
        want = llama3_rope_divisors(head_dim, theta, factor, low, high, original)
        if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-4, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ConfigError(
        f"{ckpt.path}: its rope_freqs tensor matches no llama3 rope scaling (factor {factor:g}, low "
        "frequency factor 1, high 4, any original context)"
    )


def llama3_rope_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling (what llama.cpp stores as ``rope_freqs``)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def unpermute_query_key(ckpt: GGUFCheckpoint, key: str, x: np.ndarray) -> np.ndarray:
    """Query/key rows of a ``llama`` GGUF back in rotate-half order (llama.cpp interleaves each
    head's two rope halves); other tensors and architectures as they are."""
    proj = key.rsplit(".", 2)[-2] if key.endswith("_proj.weight") else None
    if proj not in ("q_proj", "k_proj") or ckpt.architecture != "llama":
        return x
    heads = int(ckpt.meta("attention.head_count"))
    n = heads if proj == "q_proj" else int(ckpt.meta("attention.head_count_kv", heads))
    rows, cols = x.shape
    return np.ascontiguousarray(x.reshape(n, rows // n // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))


LLAMA_GGUF = GGUFLayout(
    architectures=tuple(HUB_ARCHITECTURES),
    hf_config=hf_config,
    global_names=GLOBAL_NAMES,
    layer_names=LAYER_NAMES,
    fixup=unpermute_query_key,
    consumed=("rope_freqs.weight",),
)
