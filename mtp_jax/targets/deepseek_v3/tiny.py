"""The embedded tiny DeepSeek-V3 (``scripts/train_tiny.py``): every architectural feature (MLA,
a dense layer then group-routed MoE layers, a shared expert, one MTP layer) at a size that trains on
two CPU cores, and its initial weights."""

from __future__ import annotations

import numpy as np

from mtp_jax.targets.base import initial_hub_tensors
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors

# hidden, layers, dense MLP width, routed experts, expert width, heads, q_lora, kv_lora
PRESETS = {
    "default": (128, 8, 384, 8, 64, 4, 64, 48),
    "smoke": (32, 3, 64, 4, 16, 2, 16, 16),
}


def tiny_config(vocab_size: int, preset: str, bos: int, eos: int) -> dict:
    """The ``config.json`` of a tiny DeepSeek-V3 with one MTP layer."""
    d, layers, ffn, experts, expert_ffn, heads, q_lora, kv_lora = PRESETS[preset]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": d,
        "intermediate_size": ffn,
        "moe_intermediate_size": expert_ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": 32 if preset == "default" else 8,
        "qk_rope_head_dim": 16 if preset == "default" else 8,
        "v_head_dim": 32 if preset == "default" else 8,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4 if experts >= 8 else 2,
        "topk_group": 2 if experts >= 8 else 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def tiny_tensors(cfg: DeepseekV3Config, seed: int) -> dict[str, np.ndarray]:
    """Initial hub-layout weights (:func:`mtp_jax.targets.base.initial_hub_tensors`, the MTP
    layers counted in the depth); the MTP layers' copies of the embedding and head are the main
    ones (shared, as in DeepSeek-V3)."""
    shapes = {name: w.shape for name, w in hub_tensors(cfg, seed=0).items()}
    mtp_layers = cfg.num_nextn_predict_layers
    tensors = initial_hub_tensors(shapes, seed, cfg.num_hidden_layers + mtp_layers)
    for k in range(mtp_layers):
        pre = f"model.layers.{cfg.num_hidden_layers + k}."
        tensors[f"{pre}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[f"{pre}shared_head.head.weight"] = tensors["lm_head.weight"]
    return tensors
