"""The DeepSeek-V3 parity fixtures: their hub configs, seeds and storage (``SPECS``), and the
generator's margins."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers

DEFAULT_OUT = Path("tests/fixtures/parity")
BATCH = 2
# Minimum gap (in sigmoid-score units) between the last selected and first rejected expert / group.
ROUTING_MARGIN = 1e-3
MAX_INPUT_TRIES = 200
# transformers' greedy generate appends GREEDY_NEW tokens to the first half of each fixture's input; the
# input is re-drawn unless every greedy choice along the way beats the runner-up by GREEDY_GAP (logits).
GREEDY_NEW = 12
GREEDY_GAP = 1e-3
# DeepSeek-V3 block FP8: 128x128 weight blocks, float8_e4m3fn (largest finite value 448).
FP8_BLOCK = 128
FP8_MAX = 448.0
# The linear weights DeepSeek stores as FP8 (everything else -- embeddings, lm_head, norms, the router gate
# and its bias, eh_proj, shared_head -- stays unquantised).
FP8_KEY = re.compile(
    r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$"
)


@dataclass(frozen=True)
class FixtureSpec:
    """One tiny checkpoint: its hub config fields, seeds and how it is written."""

    name: str
    description: str
    config: dict[str, Any]
    seq_len: int
    weight_seed: int
    input_seed: int
    shards: int = 1
    kv_latent_gain: float = 1.0
    # "float32"; "bfloat16" (every tensor BF16 except the float32 e_score_correction_bias); "fp8" (DeepSeek
    # block-FP8: the linear weights F8_E4M3 + float32 ``weight_scale_inv``, the rest like "bfloat16")
    storage: str = "float32"
    notes: list[str] = field(default_factory=list)


def hub_config(**overrides: Any) -> dict[str, Any]:
    """A config.json dict with the field names and ordering of the real deepseek-ai/DeepSeek-V3 hub file."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 48,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "kv_lora_rank": 24,
        "max_position_embeddings": 128,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 16,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "v_head_dim": 8,
        "vocab_size": 128,
    }
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}")
    cfg.update(overrides)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def with_fp8_quantization(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` plus the ``quantization_config`` block of the real FP8 hub checkpoints, at its hub position."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        out[key] = value
        if key == "qk_rope_head_dim":
            out["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            }
    return out


def yarn(factor: float, original_max: int, mscale: float, mscale_all_dim: float) -> dict[str, Any]:
    """A hub-style ``rope_scaling`` block (same keys as deepseek-ai/DeepSeek-V3's config.json)."""
    return {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": factor,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
        "original_max_position_embeddings": original_max,
        "type": "yarn",
    }


SPECS: list[FixtureSpec] = [
    FixtureSpec(
        name="base",
        description="q_lora on, plain RoPE, 3 layers (1 dense + 2 MoE), 8 experts in 4 groups, top-2 of 2",
        config=hub_config(),
        seq_len=24,
        weight_seed=1001,
        input_seed=2001,
    ),
    FixtureSpec(
        name="yarn",
        description=(
            "base + YaRN (factor 4, orig 16, mscale 0.9 != mscale_all_dim 0.7), T=32 > 16; qk_rope 16 and "
            "rope_theta 10 so the YaRN ramp blends 3 of the 8 frequencies (ramp 0, .25, .5, .75, 1, ...)"
        ),
        config=hub_config(
            max_position_embeddings=64,
            qk_rope_head_dim=16,
            rope_theta=10,
            rope_scaling=yarn(factor=4, original_max=16, mscale=0.9, mscale_all_dim=0.7),
        ),
        seq_len=32,
        weight_seed=1002,
        input_seed=2002,
    ),
    FixtureSpec(
        name="nogroup_dense2",
        description="n_group 1, 2 dense + 2 MoE layers, norm_topk_prob false, scale 1, top-3 of 6, 2 shared",
        config=hub_config(
            num_hidden_layers=4,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
            n_routed_experts=6,
            num_experts_per_tok=3,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            intermediate_size=48,
        ),
        seq_len=28,
        weight_seed=1003,
        input_seed=2003,
    ),
    FixtureSpec(
        name="odd_heads",
        description=(
            "5 heads, nope 8 / rope 4 / v 6, q_lora_rank null (q_proj), 10 experts in 2 groups, top-3 of 1 "
            "group, rope_theta 500, rms_norm_eps 1e-5 (latent norms keep 1e-6)"
        ),
        config=hub_config(
            vocab_size=112,
            hidden_size=40,
            intermediate_size=56,
            num_attention_heads=5,
            q_lora_rank=None,
            kv_lora_rank=20,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            n_routed_experts=10,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=3,
            moe_intermediate_size=8,
            rope_theta=500,
            rms_norm_eps=1e-05,
        ),
        seq_len=21,
        weight_seed=1004,
        input_seed=2004,
        kv_latent_gain=0.03,
        notes=[
            "rms_norm_eps is 1e-5 here on purpose: transformers (like DeepSeek's reference code) builds "
            "q_a_layernorm / kv_a_layernorm with the RMSNorm default eps 1e-6, NOT config.rms_norm_eps; the "
            "kv latent rows of kv_a_proj_with_mqa are scaled by 0.03 so using 1e-5 there changes the logits.",
        ],
    ),
    FixtureSpec(
        name="sharded",
        description="base-shaped model written as 2 safetensors shards + model.safetensors.index.json",
        config=hub_config(),
        seq_len=20,
        weight_seed=1005,
        input_seed=2005,
        shards=2,
    ),
    FixtureSpec(
        name="yarn_default_mscale",
        description=(
            "YaRN factor 8, orig 8, mscale = mscale_all_dim = 1.0 (real V3 values: cos/sin factor 1, softmax "
            "scale * mscale^2), qk_rope 8, 2 layers, all MoE"
        ),
        config=hub_config(
            num_hidden_layers=2,
            qk_rope_head_dim=8,
            first_k_dense_replace=0,
            max_position_embeddings=64,
            rope_scaling=yarn(factor=8, original_max=8, mscale=1.0, mscale_all_dim=1.0),
        ),
        seq_len=36,
        weight_seed=1006,
        input_seed=2006,
    ),
    FixtureSpec(
        name="fp8_mtp",
        description=(
            "DeepSeek block-FP8 storage (F8_E4M3 + weight_scale_inv, 128x128 blocks, partial edge blocks in "
            "both dims: H 160, q_lora 136, kv_lora 144, I 200, moe_I 40) + MTP layer 3; 2 heads, nope 16 / "
            "rope 8 / v 16, 8 experts in 4 groups, top-2 of 2"
        ),
        config=with_fp8_quantization(
            hub_config(
                hidden_size=160,
                intermediate_size=200,
                moe_intermediate_size=40,
                q_lora_rank=136,
                kv_lora_rank=144,
                num_attention_heads=2,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                num_nextn_predict_layers=1,
                torch_dtype="bfloat16",
            )
        ),
        seq_len=18,
        weight_seed=1007,
        input_seed=2007,
        storage="fp8",
        notes=[
            "FP8 storage as in deepseek-ai/DeepSeek-V3: every `self_attn.*_proj` and `mlp.*_proj` weight is "
            "F8_E4M3 with a float32 `<name>_scale_inv` [ceil(out/128), ceil(in/128)]; W = float32(fp8) * "
            "scale_inv[r // 128, c // 128] (a float32 multiply; edge blocks are partial). Quantised like "
            "DeepSeek: per block scale_inv = max|W_block| / 448 (float32), fp8 = round-to-nearest-even("
            "W_block / scale_inv). Block magnitudes differ by a checkerboard of gains, so a wrong block "
            "index, a transposed scale or a divide instead of multiply changes the result. Unquantised "
            "tensors (embeddings, lm_head, norms, `mlp.gate.weight`, `eh_proj`, `shared_head.*`) are BF16, "
            "`e_score_correction_bias` is F32. The reference is transformers on the float32 dequantisation.",
            "Partial blocks are real: DeepSeek-V3's `kv_a_proj_with_mqa` is [576, 7168] (4.5 row blocks). "
            "Do not use transformers' own FP8 loading as a reference: in 5.23 its CPU `dequantize` path "
            "takes the block size as rows // scale_rows (68 for 136 rows here), which silently mis-scales "
            "partial blocks (and raises for 576 rows).",
        ],
    ),
    FixtureSpec(
        name="sharded_mtp_bf16",
        description=(
            "base-shaped model in BF16 (e_score_correction_bias F32) with an MTP layer 3, as 3 safetensors "
            "shards + index"
        ),
        config=hub_config(num_nextn_predict_layers=1, torch_dtype="bfloat16"),
        seq_len=22,
        weight_seed=1008,
        input_seed=2008,
        shards=3,
        storage="bfloat16",
    ),
]
