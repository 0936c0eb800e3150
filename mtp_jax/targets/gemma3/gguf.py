"""Gemma 3's GGUF files (llama.cpp architecture ``gemma3``): the config from the metadata and
llama.cpp's tensor names.

llama.cpp's converter stores every ``*norm.weight`` as ``1 + w`` (its graph multiplies by the stored
weight); our parameters keep the hub's ``w`` (the forward multiplies by ``1 + w``), so 1 is taken
off as each norm is read. Query and key rows are stored in the hub's order (llama.cpp runs Gemma
with rotate-half rope). What the metadata does not carry is llama.cpp's fixed choice for the
architecture: local layers' rope base 10,000, every sixth layer global, scores scaled by
1/sqrt(head_dim). A file of the 62-layer 27B model (llama.cpp scales its queries differently) and
one declaring soft caps are refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mtp_jax.checkpoint.gguf import GGUFCheckpoint, GGUFLayout
from mtp_jax.errors import ConfigError
from mtp_jax.targets.llama.gguf import GLOBAL_NAMES

# Gemma's own mapping (not Llama's: its ffn_norm is the norm BEFORE the MLP, and
# post_attention_norm a true post-attention norm)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
LOCAL_ROPE_BASE = 10000.0
PATTERN = 6


def hf_config(ckpt: GGUFCheckpoint) -> dict:
    """The ``Gemma3ForCausalLM`` config.json of a ``gemma3`` GGUF, from its metadata and llama.cpp's
    fixed choices for the architecture (module docstring)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if ckpt.meta(key, None) is not None:
            raise ConfigError(f"{ckpt.path}: GGUF metadata '{ckpt.architecture}.{key}' is not supported")
    if ckpt.meta("rope.scaling.type", None) not in (None, "none"):
        raise ConfigError(f"{ckpt.path}: rope scaling {ckpt.meta('rope.scaling.type')!r} is not supported")
    layers = int(ckpt.meta("block_count"))
    if layers == 62:
        raise ConfigError(
            f"{ckpt.path}: the 62-layer Gemma 3 27B scales its queries by hidden/heads, which this reader "
            "does not apply; not supported"
        )
    heads = int(ckpt.meta("attention.head_count"))
    head_dim = int(ckpt.meta("attention.key_length"))
    if int(ckpt.meta("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{ckpt.path}: key and value heads of different widths are not supported")
    tokens = ckpt.metadata.get("tokenizer.ggml.tokens")
    vocab = (
        ckpt.tensor_shape("token_embd.weight")[0]
        if ckpt.has_tensor("token_embd.weight")
        else len(tokens or ())
    )
    raw: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": int(ckpt.meta("embedding_length")),
        "intermediate_size": int(ckpt.meta("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(ckpt.meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(ckpt.meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(ckpt.meta("rope.freq_base", 1e6)),
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "sliding_window": int(ckpt.meta("attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": int(ckpt.meta("context_length", 32768)),
        "tie_word_embeddings": not ckpt.has_tensor("output.weight"),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    for key, out in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if key in ckpt.metadata:
            raw[out] = int(ckpt.metadata[key])
    return raw


def hub_norm(ckpt: GGUFCheckpoint, key: str, x: np.ndarray) -> np.ndarray:
    """A norm weight back in the hub's convention (``w``, llama.cpp stores ``1 + w``)."""
    if key.endswith("norm.weight"):
        return (x.astype(np.float32) - 1.0).astype(x.dtype)
    return x


__all__ = ["GEMMA3_GGUF", "GLOBAL_NAMES", "LAYER_NAMES", "hf_config"]

GEMMA3_GGUF = GGUFLayout(
    architectures=("gemma3",),
    hf_config=hf_config,
    global_names=GLOBAL_NAMES,
    layer_names=LAYER_NAMES,
    fixup=hub_norm,
)
