"""Generate tiny random DeepSeek-V3 checkpoints plus transformers reference outputs (parity fixtures).

Each fixture directory ``<out>/<name>/`` holds a checkpoint in the exact Hugging Face hub layout
(``config.json`` written with the hub's field names, i.e. ``rope_scaling`` rather than transformers-5's
``rope_parameters``; safetensors, one file or shards plus ``model.safetensors.index.json``) and a
``reference.npz`` produced by ``transformers.DeepseekV3ForCausalLM`` (float32,
``attn_implementation="eager"``, single CPU thread) on a teacher-forced forward pass over ``input_ids``.

Storage (``FixtureSpec.storage``): float32; BF16 (every tensor except the float32
``e_score_correction_bias``); or DeepSeek-V3 block FP8 exactly as on the hub (``quantization_config``
``fp8``/``e4m3``/``dynamic``/[128, 128]; every ``self_attn.*_proj`` and ``mlp.*_proj`` weight F8_E4M3 with a
float32 ``<name>_scale_inv`` [ceil(out/128), ceil(in/128)], W = float32(fp8) * scale_inv[r//128, c//128];
the rest BF16 as above).  transformers always runs the exact float32 values: the BF16 checkpoint is loaded
with ``dtype=float32``, the FP8 one is dequantised here (numpy, checked against a torch read-back of the
written files) into a temporary float32 hub copy.  Fixtures with ``num_nextn_predict_layers: 1`` carry the
MTP layer ``model.layers.{N}.`` (N = num_hidden_layers) and MTP references computed with transformers'
generic ``MtpModel`` (see ``MTP_DOC``).

``reference.npz`` arrays:

* ``input_ids``             int32   [B, T]
* ``logits``                float32 [B, T, V]  full logits of the forward pass
* ``hidden_states``         float32 [L+1, B, T, H]  ``output_hidden_states=True`` tuple, stacked (see below)
* ``hidden_states_doc``     str     [1]  the convention below, in words
* ``last_hidden_post_norm`` float32 [B, T, H]  ``model.model(input_ids).last_hidden_state``
* ``layer_outputs``         float32 [L, B, T, H]  raw output (residual stream, before any final norm) of every
  decoder layer, captured with forward hooks
* ``greedy``                int32   [B, P + N]  ``generate(input_ids[:, :P], max_new_tokens=N,
  do_sample=False)`` (P = ``prompt_length`` = T // 2, N = ``new_tokens``; no EOS), with every routing
  decision and every greedy choice along the generated text (checked teacher-forced) beyond its margin
* MTP fixtures only: ``mtp_logits`` float32 [B, T-1, V], ``mtp_hidden`` float32 [B, T-1, H] (after
  ``shared_head.norm``), ``mtp_block_output`` float32 [B, T-1, H] (before it), ``mtp_doc`` str [1]: row i is
  the MTP layer on (h_i = ``last_hidden_post_norm[:, i]``, token ``input_ids[:, i+1]``), predicting token i+2

Hidden-states convention of transformers 5 for DeepseekV3 (verified by this script with forward hooks on every
run; it aborts if it ever changes): the tuple has ``num_hidden_layers + 1`` entries;
``hidden_states[0]`` is the token embedding (input of layer 0); ``hidden_states[i]`` for ``1 <= i < L`` is the
output of decoder layer ``i - 1`` (= input of layer ``i``); ``hidden_states[L]`` is NOT the raw output of the
last decoder layer but that output after the final ``model.norm`` RMSNorm, i.e. identical to
``last_hidden_post_norm`` (``capture_outputs(tie_last_hidden_states=True)`` overwrites the last entry).  The
pre-norm output of the last layer is only available as ``layer_outputs[L - 1]``.

Weights are drawn with ``numpy.random.default_rng(seed)``; the script is deterministic (fixed seeds, one torch
thread, zip entries with a fixed timestamp), so re-running it rewrites byte-identical files.  Every tensor of
the loaded model is compared exactly with the numpy weights (transformers fuses the per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` keys into ``mlp.experts.gate_up_proj`` [E, 2*I, H] and
``mlp.experts.down_proj`` [E, H, I] on load), the rotary/yarn setup is checked against an independent
recomputation, and inputs are re-drawn until every MoE routing decision (the MTP layer's included) has a safe
margin, so that a correct float32 implementation cannot flip an expert or group choice through rounding.
Every reference is also recomputed by an independent float64 numpy forward of the DeepSeek equations
(``np_reference``) and must agree to 1e-4 relative.  README.md is rewritten on every run from the fixture
directories on disk (once all of them exist), so ``--only`` leaves the other fixtures untouched.

Usage::

    python scripts/make_parity_fixtures.py [--out tests/fixtures/parity] [--only NAME ...]

Needs ``torch`` and ``transformers>=5`` (``pip install -e .[parity]``).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

try:
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from transformers import AutoConfig, DeepseekV3ForCausalLM
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel
except ImportError as exc:  # pragma: no cover - exercised only without the optional deps
    sys.stderr.write(
        "make_parity_fixtures.py needs torch, transformers>=5 and safetensors to generate the reference "
        f"outputs ({exc}).\nInstall them with `pip install -e .[parity]` (torch CPU is enough).\n"
    )
    raise SystemExit(2) from exc

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

HIDDEN_STATES_DOC = (
    "hidden_states[k], k=0..L (L=num_hidden_layers), from transformers "
    f"{transformers.__version__} DeepseekV3ForCausalLM(output_hidden_states=True): k=0 is the token "
    "embedding (input of layer 0); 1<=k<L is the output of decoder layer k-1 (residual stream, no norm); "
    "k=L is the output of the last decoder layer AFTER the final model.norm RMSNorm, i.e. equal to "
    "last_hidden_post_norm (the pre-norm output of the last layer is layer_outputs[L-1])."
)

MTP_DOC = (
    "mtp_logits [B,T-1,V], mtp_hidden [B,T-1,H], mtp_block_output [B,T-1,H]: the NextN/MTP layer "
    "model.layers.N (N=num_hidden_layers) run teacher-forced over the pairs (h_i, t_{i+1}), i=0..T-2, "
    "where t=input_ids and h=last_hidden_post_norm (= hidden_states[L], the target's last hidden state "
    "AFTER the final model.norm); row i predicts token i+2. x_i = eh_proj(concat([enorm(E[t_{i+1}]), "
    "hnorm(h_i)], -1)) with the embedding FIRST (E = model.embed_tokens.weight = layer N's embed_tokens "
    "copy); mtp_block_output = DeepseekV3DecoderLayer N (MLA + MoE with its own router, bias and shared "
    "expert) over the T-1 rows x_0..x_{T-2}, causal over that sequence only (row i attends rows 0..i; "
    "nothing is masked at position 0), RoPE position of row i = i+1 (the position of t_{i+1}, as "
    "transformers does; position i, as SGLang/vLLM do, gives the same values to ~1e-6 since RoPE is "
    "relative); mtp_hidden = shared_head.norm(mtp_block_output) (RMSNorm, rms_norm_eps); mtp_logits = "
    "mtp_hidden @ shared_head.head.weight^T (= lm_head.weight). Computed with transformers "
    f"{transformers.__version__}: MtpModel.from_pretrained(DeepseekV3ForCausalLM).forward_layer(0, "
    "last_hidden_states=h[:, :T-1], position_ids=1..T-1, mtp_cache=MtpCache(), input_ids=t[:, 1:]) then "
    "MtpModel._project_to_logits (float32, eager); cross-checked against MtpModel.forward (the "
    "generate(use_mtp=True) drafting path) at the last row and against an independent float64 numpy "
    "forward of the DeepSeek MTP equations."
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


# --------------------------------------------------------------------------------------------------- weights


def make_weights(cfg: dict[str, Any], seed: int, kv_latent_gain: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 weights in hub layout (nn.Linear [out, in]); iteration order is the write order.

    ``kv_latent_gain`` scales the kv_lora rows of ``kv_a_proj_with_mqa`` (the part that only feeds
    ``kv_a_layernorm``); a small gain makes the latent's variance small enough for that norm's eps to matter.
    With ``num_nextn_predict_layers`` > 0 the MTP layers ``model.layers.{N + k}.`` (N = num_hidden_layers)
    are drawn last from the same generator: a full MoE decoder layer plus ``enorm``, ``hnorm``, ``eh_proj``
    [H, 2H], ``shared_head.norm`` and exact copies of ``lm_head.weight`` (``shared_head.head.weight``) and
    ``model.embed_tokens.weight`` (``embed_tokens.weight``), as in the DeepSeek-V3 hub checkpoint.
    """
    rng = np.random.default_rng(seed)
    hid = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    n_exp, moe_i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) * (gain / math.sqrt(in_dim))).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    w: dict[str, np.ndarray] = {}

    def decoder_layer(p: str, dense: bool) -> None:
        w[p + "input_layernorm.weight"] = norm(hid)
        if q_lora is None:
            w[p + "self_attn.q_proj.weight"] = linear(heads * (nope + rope), hid)
        else:
            w[p + "self_attn.q_a_proj.weight"] = linear(q_lora, hid)
            w[p + "self_attn.q_a_layernorm.weight"] = norm(q_lora)
            w[p + "self_attn.q_b_proj.weight"] = linear(heads * (nope + rope), q_lora)
        kv_a = linear(kv_lora + rope, hid)
        kv_a[:kv_lora] *= np.float32(kv_latent_gain)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = kv_a
        w[p + "self_attn.kv_a_layernorm.weight"] = norm(kv_lora)
        w[p + "self_attn.kv_b_proj.weight"] = linear(heads * (nope + vdim), kv_lora)
        w[p + "self_attn.o_proj.weight"] = linear(hid, heads * vdim, gain=0.7)
        w[p + "post_attention_layernorm.weight"] = norm(hid)
        if dense:
            inter = cfg["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = linear(inter, hid)
            w[p + "mlp.up_proj.weight"] = linear(inter, hid)
            w[p + "mlp.down_proj.weight"] = linear(hid, inter, gain=0.7)
        else:
            w[p + "mlp.gate.weight"] = linear(n_exp, hid, gain=1.5)
            w[p + "mlp.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(n_exp)).astype(np.float32)
            for e in range(n_exp):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(moe_i, hid)
                w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(moe_i, hid)
                w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(hid, moe_i, gain=0.7)
            shared = moe_i * cfg["n_shared_experts"]
            w[p + "mlp.shared_experts.gate_proj.weight"] = linear(shared, hid)
            w[p + "mlp.shared_experts.up_proj.weight"] = linear(shared, hid)
            w[p + "mlp.shared_experts.down_proj.weight"] = linear(hid, shared, gain=0.7)

    w["model.embed_tokens.weight"] = rng.standard_normal((cfg["vocab_size"], hid)).astype(np.float32)
    n_layers = cfg["num_hidden_layers"]
    for i in range(n_layers):
        decoder_layer(f"model.layers.{i}.", dense=i < cfg["first_k_dense_replace"])
    w["model.norm.weight"] = norm(hid)
    w["lm_head.weight"] = linear(cfg["vocab_size"], hid, gain=2.0)
    for i in range(n_layers, n_layers + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        decoder_layer(p, dense=False)
        w[p + "enorm.weight"] = norm(hid)
        w[p + "hnorm.weight"] = norm(hid)
        w[p + "eh_proj.weight"] = linear(hid, 2 * hid)
        w[p + "shared_head.norm.weight"] = norm(hid)
        w[p + "shared_head.head.weight"] = w["lm_head.weight"].copy()
        w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"].copy()
    return w


def write_checkpoint(dst: Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], shards: int) -> None:
    """config.json plus one safetensors file, or ``shards`` files and a hub-style index."""
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    meta = {"format": "pt"}
    if shards == 1:
        save_file(weights, str(dst / "model.safetensors"), metadata=meta)
        return
    keys = list(weights)
    total = sum(int(a.nbytes) for a in weights.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for k in keys:  # contiguous split by bytes, like the hub's sharding
        groups[min(shards - 1, acc * shards // total)].append(k)
        acc += int(weights[k].nbytes)
    weight_map: dict[str, str] = {}
    for s, group in enumerate(groups):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: weights[k] for k in group}, str(dst / fname), metadata=meta)
        weight_map.update(dict.fromkeys(group, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def block_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """Number of FP8 blocks along (out, in) of a 2-D weight: [ceil(out/128), ceil(in/128)]."""
    return -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)


def expand_blocks(per_block: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Per-block values [R, C] -> per-element [out, in]: element (r, c) gets per_block[r // 128, c // 128]."""
    full = np.repeat(np.repeat(per_block, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return full[: shape[0], : shape[1]]


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's block quantisation: (fp8 [out, in], scale_inv float32 [R, C]), scale_inv = amax / 448."""
    rows, cols = block_grid(w.shape)
    scale_inv = np.empty((rows, cols), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            blk = (slice(r * FP8_BLOCK, (r + 1) * FP8_BLOCK), slice(c * FP8_BLOCK, (c + 1) * FP8_BLOCK))
            s = np.float32(np.abs(w[blk]).max()) / np.float32(FP8_MAX)
            scale_inv[r, c] = s
            q[blk] = (w[blk] / s).astype(ml_dtypes.float8_e4m3fn)
    as_f32 = q.astype(np.float32)
    if not np.isfinite(as_f32).all() or np.abs(as_f32).max() > FP8_MAX:
        raise RuntimeError("fp8 quantisation overflowed")
    return q, scale_inv


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """The reference dequantisation: float32(fp8) * scale_inv[r // 128, c // 128], one float32 multiply."""
    return q.astype(np.float32) * expand_blocks(scale_inv, q.shape)


def encode_weights(
    spec: FixtureSpec, weights: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(tensors as written to the checkpoint, their exact float32 values in hub layout for the reference).

    For "fp8" each quantised weight is first multiplied by a checkerboard of per-block gains
    2**(+-U(0.3, 1)) (neighbouring blocks differ by >= 1.5x), then block-quantised; the float32 reference
    value is its dequantisation.  Keys keep their hub order, each ``_scale_inv`` right after its weight.
    """
    if spec.storage == "float32":
        return weights, weights
    if spec.storage not in ("bfloat16", "fp8"):
        raise ValueError(f"unknown storage {spec.storage!r}")
    rng = np.random.default_rng([spec.weight_seed, 8])
    stored: dict[str, np.ndarray] = {}
    exact: dict[str, np.ndarray] = {}
    for key, value in weights.items():
        if spec.storage == "fp8" and FP8_KEY.search(key):
            rows, cols = block_grid(value.shape)
            sign = np.where((np.arange(rows)[:, None] + np.arange(cols)[None, :]) % 2 == 0, 1.0, -1.0)
            gains = (2.0 ** (sign * rng.uniform(0.3, 1.0, size=(rows, cols)))).astype(np.float32)
            scaled = value * expand_blocks(gains, value.shape)
            q, scale_inv = quantize_fp8(scaled)
            stored[key] = q
            stored[key + "_scale_inv"] = scale_inv
            exact[key] = dequantize_fp8(q, scale_inv)
            # e4m3: 3 mantissa bits -> |error| <= 2^-4 |w| (normal) or half a subnormal step 2^-10 * scale
            bound = np.maximum(np.abs(scaled) * 2.0**-4, 2.0**-10 * expand_blocks(scale_inv, value.shape))
            if (np.abs(exact[key].astype(np.float64) - scaled) > bound * (1 + 1e-6)).any():
                raise RuntimeError(f"{key}: fp8 rounding error above the e4m3 bound")
        elif key.endswith(".e_score_correction_bias"):
            stored[key] = value
            exact[key] = value
        else:
            stored[key] = value.astype(ml_dtypes.bfloat16)
            exact[key] = stored[key].astype(np.float32)
    return stored, exact


def float32_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json of the float32 (dequantised / upcast) copy that transformers runs for the reference."""
    out = {k: v for k, v in cfg.items() if k != "quantization_config"}
    out["torch_dtype"] = "float32"
    return out


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (dtype, shape, data_offsets per tensor)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def check_stored(
    dst: Path, spec: FixtureSpec, stored: dict[str, np.ndarray], exact: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Re-read the written checkpoint with safetensors' torch backend and check dtypes and (de)quantisation.

    Independent of the numpy path above: torch decodes the F8_E4M3 / BF16 bytes and expands the scales with
    ``repeat_interleave``.  For FP8 also checks that partial blocks exist and that the block scales of the
    multi-block weights really differ (so a wrong block index cannot go unnoticed).
    """
    plain = "F32" if spec.storage == "float32" else "BF16"
    headers: dict[str, dict[str, Any]] = {}
    for f in sorted(dst.glob("*.safetensors")):
        headers.update({k: v for k, v in safetensors_header(f).items() if k != "__metadata__"})
    if set(headers) != set(stored):
        raise RuntimeError(f"{spec.name}: written keys differ from the weights")
    min_ratio = math.inf
    n_partial = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                dtype = headers[key]["dtype"]
                if key.endswith("_scale_inv") or key.endswith(".e_score_correction_bias"):
                    expect = "F32"
                elif spec.storage == "fp8" and FP8_KEY.search(key):
                    expect = "F8_E4M3"
                else:
                    expect = plain
                if dtype != expect:
                    raise RuntimeError(f"{spec.name}: {key} stored as {dtype}, expected {expect}")
                if key.endswith("_scale_inv"):
                    continue
                t = st.get_tensor(key)
                if dtype == "F8_E4M3":
                    scale = st.get_tensor(key + "_scale_inv")  # same file as its weight, as on the hub
                    rows, cols = t.shape
                    if tuple(scale.shape) != block_grid(t.shape):
                        raise RuntimeError(f"{spec.name}: {key}_scale_inv has shape {tuple(scale.shape)}")
                    full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[
                        :, :cols
                    ]
                    got = (t.to(torch.float32) * full).numpy()
                    n_partial += int(rows % FP8_BLOCK != 0) + int(cols % FP8_BLOCK != 0)
                    if scale.numel() > 1:
                        min_ratio = min(min_ratio, float(scale.max() / scale.min()))
                else:
                    got = t.to(torch.float32).numpy()
                if not np.array_equal(got, exact[key]):
                    raise RuntimeError(
                        f"{spec.name}: {key} read back by torch differs from the reference value"
                    )
    if spec.storage == "fp8":
        if min_ratio < 1.2:
            raise RuntimeError(f"{spec.name}: block scales too similar (max/min {min_ratio:.3f})")
        if n_partial == 0:
            raise RuntimeError(f"{spec.name}: no partial FP8 blocks")
    return {
        "fp8_weights": sum(1 for h in headers.values() if h["dtype"] == "F8_E4M3"),
        "fp8_min_scale_ratio": min_ratio,
        "dtypes": sorted({h["dtype"] for h in headers.values()}),
    }


# --------------------------------------------------------------------------------------------------- checks


def is_mtp_key(cfg: dict[str, Any], key: str) -> bool:
    """True for keys of the MTP layers ``model.layers.{i}.`` with i >= num_hidden_layers."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= cfg["num_hidden_layers"]


def fused_experts(weights: dict[str, np.ndarray], p: str, n_exp: int) -> dict[str, np.ndarray]:
    """transformers' fused expert tensors for the MoE layer with key prefix ``p``."""
    p += "mlp.experts."
    return {
        p + "gate_up_proj": np.stack(
            [
                np.concatenate([weights[f"{p}{e}.gate_proj.weight"], weights[f"{p}{e}.up_proj.weight"]])
                for e in range(n_exp)
            ]
        ),
        p + "down_proj": np.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(n_exp)]),
    }


def expected_state_dict(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What transformers' module state_dict must hold: hub keys with the experts fused per layer (no MTP)."""
    out: dict[str, np.ndarray] = {}
    for k, v in weights.items():
        if ".mlp.experts." not in k and not is_mtp_key(cfg, k):
            out[k] = v
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        out.update(fused_experts(weights, f"model.layers.{i}.", cfg["n_routed_experts"]))
    return out


def expected_unexpected_keys(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> set[str]:
    """The MTP-layer keys DeepseekV3ForCausalLM.from_pretrained must report as unexpected (experts fused)."""
    out = {k for k in weights if is_mtp_key(cfg, k) and ".mlp.experts." not in k}
    for i in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        out |= {f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"}
    return out


def expected_mtp_state_dict(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What transformers' MtpModel state_dict must hold for the hub's ``model.layers.{N}.*`` keys."""
    p = f"model.layers.{cfg['num_hidden_layers']}."
    renamed = {
        "enorm.weight": "layers.0.enorm.weight",
        "hnorm.weight": "layers.0.hnorm.weight",
        "eh_proj.weight": "layers.0.eh_proj.weight",
        "shared_head.norm.weight": "layers.0.post_norm.weight",
        "shared_head.head.weight": "shared_head.weight",
        "embed_tokens.weight": "embed_tokens.weight",
    }
    out: dict[str, np.ndarray] = {}
    for k, v in weights.items():
        if k.startswith(p) and ".mlp.experts." not in k:
            rest = k[len(p) :]
            out[renamed.get(rest, "layers.0.mtp_block." + rest)] = v
    for k, v in fused_experts(weights, p, cfg["n_routed_experts"]).items():
        out["layers.0.mtp_block." + k[len(p) :]] = v
    return out


def check_loaded(
    model: DeepseekV3ForCausalLM, info: dict[str, Any], cfg: dict[str, Any], weights: dict[str, np.ndarray]
) -> None:
    """Fail unless every tensor of the model equals the numpy weights bit for bit.

    The only keys allowed to stay unloaded are those of the MTP layer, and all of them must be reported.
    """
    for kind in ("missing_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            raise RuntimeError(f"from_pretrained reported {kind}: {info[kind]}")
    unexpected, want = set(info.get("unexpected_keys") or ()), expected_unexpected_keys(cfg, weights)
    if unexpected != want:
        raise RuntimeError(
            f"from_pretrained unexpected keys {sorted(unexpected)} != the MTP layer's keys {sorted(want)}"
        )
    expected = expected_state_dict(cfg, weights)
    state = model.state_dict()
    if set(state) != set(expected):
        raise RuntimeError(
            f"state_dict keys differ: model-only {sorted(set(state) - set(expected))}, "
            f"checkpoint-only {sorted(set(expected) - set(state))}"
        )
    for k, ref in expected.items():
        got = state[k].detach().cpu()
        if got.dtype != torch.float32:
            raise RuntimeError(f"{k}: loaded as {got.dtype}, expected float32")
        if tuple(got.shape) != ref.shape or not np.array_equal(got.numpy(), ref):
            raise RuntimeError(f"{k}: loaded tensor differs from the checkpoint")


def reference_yarn(cfg: dict[str, Any]) -> tuple[np.ndarray, float, float]:
    """Independent float64 recomputation of (inv_freq, cos/sin factor, softmax scale), DeepSeek-V3 style."""
    dim, base = cfg["qk_rope_head_dim"], float(cfg["rope_theta"])
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = cfg["rope_scaling"]
    if rs is None:
        return freqs, 1.0, scale

    def mscale(s: float, m: float) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    def corr_dim(rot: float) -> float:
        orig = rs["original_max_position_embeddings"]
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    factor = rs["factor"]
    low = max(math.floor(corr_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rs["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq = freqs / factor * ramp + freqs * (1 - ramp)
    attn_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
    m = mscale(factor, rs["mscale_all_dim"])
    return inv_freq, attn_factor, scale * m * m


def check_config(model: DeepseekV3ForCausalLM, cfg: dict[str, Any]) -> dict[str, Any]:
    """Check transformers parsed config.json as intended (incl. yarn); return facts for the README."""
    c = model.config
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "norm_topk_prob",
        "routed_scaling_factor",
        "rms_norm_eps",
        "moe_intermediate_size",
    ):
        if getattr(c, key) != cfg[key]:
            raise RuntimeError(f"config.{key}: transformers read {getattr(c, key)!r}, file has {cfg[key]!r}")
    if c.rope_interleave is not True:
        raise RuntimeError(
            "expected rope_interleave=True (transformers' default for hub DeepSeek-V3 configs)"
        )
    rotary = model.model.rotary_emb
    want_type = "default" if cfg["rope_scaling"] is None else "yarn"
    if rotary.rope_type != want_type:
        raise RuntimeError(f"rotary_emb.rope_type is {rotary.rope_type!r}, expected {want_type!r}")
    if c.rope_parameters["rope_theta"] != cfg["rope_theta"]:
        raise RuntimeError(f"rope_theta read as {c.rope_parameters['rope_theta']}")
    inv_freq, attn_factor, softmax_scale = reference_yarn(cfg)
    got_inv = rotary.inv_freq.double().numpy()
    if not np.allclose(got_inv, inv_freq, rtol=1e-6, atol=0):
        raise RuntimeError(f"inv_freq {got_inv} != reference {inv_freq}")
    if not math.isclose(rotary.attention_scaling, attn_factor, rel_tol=1e-9):
        raise RuntimeError(f"rotary attention_scaling {rotary.attention_scaling} != {attn_factor}")
    for layer in model.model.layers:
        attn = layer.self_attn
        if not math.isclose(attn.scaling, softmax_scale, rel_tol=1e-9):
            raise RuntimeError(f"softmax scaling {attn.scaling} != {softmax_scale}")
        if attn.kv_a_layernorm.variance_epsilon != 1e-6:
            raise RuntimeError("kv_a_layernorm eps is not 1e-6")
        if attn.q_a_layernorm is not None and attn.q_a_layernorm.variance_epsilon != 1e-6:
            raise RuntimeError("q_a_layernorm eps is not 1e-6")
        if layer.input_layernorm.variance_epsilon != cfg["rms_norm_eps"]:
            raise RuntimeError("input_layernorm eps differs from rms_norm_eps")
    if model.model.norm.variance_epsilon != cfg["rms_norm_eps"]:
        raise RuntimeError("final norm eps differs from rms_norm_eps")
    return {
        "rope_type": rotary.rope_type,
        "inv_freq": [float(x) for x in got_inv],
        "cos_sin_attention_factor": float(rotary.attention_scaling),
        "softmax_scale": float(model.model.layers[0].self_attn.scaling),
        "softmax_scale_without_mscale": (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5,
    }


def routing_margin(router_logits: np.ndarray, bias: np.ndarray, cfg: dict[str, Any]) -> float:
    """Smallest gap between the last selected and the first rejected group / expert (float64 recompute)."""
    n_group, topk_group, top_k = cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]
    n_exp = cfg["n_routed_experts"]
    scores = 1.0 / (1.0 + np.exp(-router_logits.astype(np.float64)))
    choice = scores + bias.astype(np.float64)
    grouped = choice.reshape(-1, n_group, n_exp // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    margin = math.inf
    if topk_group < n_group:
        gs = np.sort(group_scores, axis=-1)[:, ::-1]
        margin = min(margin, float((gs[:, topk_group - 1] - gs[:, topk_group]).min()))
    keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    masked = np.where(np.repeat(mask, n_exp // n_group, axis=-1), choice, -np.inf)
    ms = np.sort(masked, axis=-1)[:, ::-1]
    if top_k < topk_group * (n_exp // n_group):
        margin = min(margin, float((ms[:, top_k - 1] - ms[:, top_k]).min()))
    return margin


# ------------------------------------------------------------------------------ independent float64 forward


def np_rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def np_mlp(w: dict[str, np.ndarray], p: str, x: np.ndarray) -> np.ndarray:
    gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
    return (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "down_proj.weight"].T


def np_moe(w: dict[str, np.ndarray], p: str, cfg: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """DeepSeek-V3 noaux_tc routing (sigmoid, bias for the choice only, group top-2 sums) + shared experts."""
    n_exp, n_group, top_k = cfg["n_routed_experts"], cfg["n_group"], cfg["num_experts_per_tok"]
    flat = x.reshape(-1, x.shape[-1])
    scores = 1.0 / (1.0 + np.exp(-(flat @ w[p + "mlp.gate.weight"].T)))
    choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
    group_scores = np.sort(choice.reshape(len(flat), n_group, -1), axis=-1)[..., -2:].sum(-1)
    groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, : cfg["topk_group"]]
    keep = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(keep, groups, True, axis=-1)
    masked = np.where(np.repeat(keep, n_exp // n_group, axis=-1), choice, -np.inf)
    idx = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(scores, idx, axis=-1)
    if cfg["norm_topk_prob"]:
        weight = weight / weight.sum(-1, keepdims=True)
    weight = weight * cfg["routed_scaling_factor"]
    out = np_mlp(w, p + "mlp.shared_experts.", flat)
    for e in range(n_exp):
        rows, slot = np.nonzero(idx == e)
        out[rows] += weight[rows, slot, None] * np_mlp(w, p + f"mlp.experts.{e}.", flat[rows])
    return out.reshape(x.shape)


def np_attention(
    w: dict[str, np.ndarray], p: str, cfg: dict[str, Any], x: np.ndarray, pos: np.ndarray
) -> np.ndarray:
    """MLA, expanded form, causal over the S rows of x [B, S, H] at rope positions pos [S]."""
    b, s, _ = x.shape
    heads, nope, vdim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    a = p + "self_attn."
    if cfg["q_lora_rank"] is None:
        q = x @ w[a + "q_proj.weight"].T
    else:
        q = (
            np_rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6)
            @ w[a + "q_b_proj.weight"].T
        )
    q = q.reshape(b, s, heads, -1)
    kv_a = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent = np_rms(kv_a[..., :kv_lora], w[a + "kv_a_layernorm.weight"], 1e-6)
    kv = (latent @ w[a + "kv_b_proj.weight"].T).reshape(b, s, heads, nope + vdim)
    inv_freq, attn_factor, scale = reference_yarn(cfg)
    angle = pos[:, None, None] * inv_freq  # [S, 1, rope/2]
    cos, sin = np.cos(angle) * attn_factor, np.sin(angle) * attn_factor

    def rotate(t: np.ndarray) -> np.ndarray:  # interleaved pairs (t0, t1), (t2, t3), ...
        even, odd = t[..., 0::2], t[..., 1::2]
        return np.concatenate([even * cos - odd * sin, even * sin + odd * cos], axis=-1)

    q_rope, k_rope = rotate(q[..., nope:]), rotate(kv_a[..., None, kv_lora:])
    logits = np.einsum("bshd,bthd->bhst", q[..., :nope], kv[..., :nope])
    logits = (logits + np.einsum("bshd,btkd->bhst", q_rope, k_rope)) * scale
    logits = np.where(np.triu(np.ones((s, s), dtype=bool), 1), -np.inf, logits)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthd->bshd", probs, kv[..., nope:]).reshape(b, s, heads * vdim)
    return out @ w[a + "o_proj.weight"].T


def np_decoder_layer(
    w: dict[str, np.ndarray], p: str, cfg: dict[str, Any], x: np.ndarray, pos: np.ndarray, moe: bool
) -> np.ndarray:
    eps = cfg["rms_norm_eps"]
    x = x + np_attention(w, p, cfg, np_rms(x, w[p + "input_layernorm.weight"], eps), pos)
    h = np_rms(x, w[p + "post_attention_layernorm.weight"], eps)
    return x + (np_moe(w, p, cfg, h) if moe else np_mlp(w, p + "mlp.", h))


def np_reference(
    weights: dict[str, np.ndarray], cfg: dict[str, Any], input_ids: np.ndarray, h_post: np.ndarray | None
) -> dict[str, np.ndarray]:
    """Float64 numpy forward of the target and, if ``h_post`` is given, of MTP layer N (DeepSeek semantics).

    MTP: x_i = eh_proj(concat[enorm(E[t_{i+1}]), hnorm(h_i)]) for i = 0..T-2 with E = the MTP layer's own
    ``embed_tokens`` copy and h = ``h_post`` (the target's post-final-norm hidden state); decoder layer N over
    those T-1 rows, causal, rope positions 0..T-2 (the positions of h_i; transformers uses i+1, RoPE is
    relative); ``shared_head.norm``; logits with the layer's own ``shared_head.head`` copy.
    """
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    eps, n_layers = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    seq = input_ids.shape[1]
    x = w["model.embed_tokens.weight"][input_ids]
    for i in range(n_layers):
        x = np_decoder_layer(
            w,
            f"model.layers.{i}.",
            cfg,
            x,
            np.arange(seq, dtype=np.float64),
            moe=i >= cfg["first_k_dense_replace"],
        )
    post = np_rms(x, w["model.norm.weight"], eps)
    out = {"logits": post @ w["lm_head.weight"].T, "last_hidden_post_norm": post}
    if h_post is not None:
        p = f"model.layers.{n_layers}."
        emb = np_rms(w[p + "embed_tokens.weight"][input_ids[:, 1:]], w[p + "enorm.weight"], eps)
        hid = np_rms(h_post[:, :-1].astype(np.float64), w[p + "hnorm.weight"], eps)
        x = np.concatenate([emb, hid], axis=-1) @ w[p + "eh_proj.weight"].T
        block = np_decoder_layer(w, p, cfg, x, np.arange(seq - 1, dtype=np.float64), moe=True)
        out["mtp_block_output"] = block
        out["mtp_hidden"] = np_rms(block, w[p + "shared_head.norm.weight"], eps)
        out["mtp_logits"] = out["mtp_hidden"] @ w[p + "shared_head.head.weight"].T
    return out


def max_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


# --------------------------------------------------------------------------------------------------- forward


def run_greedy(
    model: DeepseekV3ForCausalLM, input_ids: np.ndarray, biases: list[np.ndarray], cfg: dict[str, Any]
) -> np.ndarray | None:
    """transformers' greedy ``generate`` (its KV cache, no EOS) from the first half of ``input_ids``:
    [B, P + GREEDY_NEW], or None when a routing decision or a greedy choice along the generated text
    (recomputed teacher-forced) is too close for a correct float32 implementation to be sure of it."""
    p = input_ids.shape[1] // 2
    model.generation_config.eos_token_id = None  # never stop early: N tokens, nothing masked
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(input_ids[:, :p].astype(np.int64)),
            attention_mask=torch.ones((input_ids.shape[0], p), dtype=torch.long),
            max_new_tokens=GREEDY_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    tokens = out.numpy()
    ref = run_reference(model, tokens)
    chosen = ref["logits"][:, p - 1 : -1]
    if not np.array_equal(chosen.argmax(-1), tokens[:, p:]):
        raise RuntimeError("generate's tokens are not the teacher-forced argmax of its own text")
    top2 = np.sort(chosen, axis=-1)[..., -2:]
    router = ref["router_logits"]  # the main layers' (an MTP layer's bias comes last in biases)
    margins = [routing_margin(r, b, cfg) for r, b in zip(router, biases[: len(router)], strict=True)]
    gap = float((top2[..., 1] - top2[..., 0]).min())
    if gap < GREEDY_GAP or min(margins, default=math.inf) < ROUTING_MARGIN:
        return None
    return tokens


def run_reference(model: DeepseekV3ForCausalLM, input_ids: np.ndarray) -> dict[str, Any]:
    """Teacher-forced forward; returns all reference arrays plus the router logits of every MoE layer."""
    layer_out: list[torch.Tensor] = []
    router_logits: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, o: layer_out.append(o.detach().clone()))
        for layer in model.model.layers
    ]
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:  # DeepseekV3TopkRouter returns (router_logits, topk_weights, topk_indices)
            hooks.append(
                gate.register_forward_hook(lambda _m, _i, o: router_logits.append(o[0].detach().clone()))
            )
    ids = torch.from_numpy(input_ids.astype(np.int64))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        post_norm = model.model(input_ids=ids, use_cache=False).last_hidden_state
    hs = [h.detach().numpy() for h in out.hidden_states]
    n_layers = len(model.model.layers)
    layers_np = np.stack([t.numpy() for t in layer_out])
    emb = model.model.embed_tokens.weight.detach().numpy()[input_ids]
    # Pin the hidden_states convention documented in HIDDEN_STATES_DOC.
    if len(hs) != n_layers + 1 or len(layer_out) != n_layers:
        raise RuntimeError(f"unexpected hidden_states length {len(hs)} for {n_layers} layers")
    if not np.array_equal(hs[0], emb):
        raise RuntimeError("hidden_states[0] is not the token embedding")
    for k in range(1, n_layers):
        if not np.array_equal(hs[k], layers_np[k - 1]):
            raise RuntimeError(f"hidden_states[{k}] is not the output of layer {k - 1}")
    if not np.array_equal(hs[n_layers], post_norm.numpy()):
        raise RuntimeError("hidden_states[L] is not last_hidden_state (post final norm)")
    if np.array_equal(hs[n_layers], layers_np[-1]):
        raise RuntimeError("hidden_states[L] unexpectedly equals the pre-norm last layer output")
    logits = out.logits.detach().numpy()
    lm = model.lm_head.weight.detach().numpy()
    if not np.allclose(logits, post_norm.numpy() @ lm.T, rtol=1e-5, atol=1e-5):
        raise RuntimeError("logits are not lm_head(last_hidden_state)")
    return {
        "logits": logits.astype(np.float32),
        "hidden_states": np.stack(hs).astype(np.float32),
        "last_hidden_post_norm": post_norm.numpy().astype(np.float32),
        "layer_outputs": layers_np.astype(np.float32),
        "router_logits": [r.numpy() for r in router_logits],
    }


def load_mtp(model: DeepseekV3ForCausalLM, cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> MtpModel:
    """transformers' generic MtpModel for layer N of ``model``'s checkpoint, checked tensor by tensor."""
    if cfg["num_nextn_predict_layers"] != 1 or model.config.num_mtp_layers != 1:
        raise RuntimeError(
            "only one MTP layer is supported (num_nextn_predict_layers = 1, as in DeepSeek-V3)"
        )
    n = cfg["num_hidden_layers"]
    # DeepseekV3 registers only r"model\.layers\.61.*" (the real V3's MTP layer) as the MTP key pattern, and
    # MtpModel.from_pretrained finds the MTP weights through it: point it at layer N of this tiny model.
    model._keys_to_ignore_on_load_unexpected = {rf"model\.layers\.{n}\..*"}
    mtp = MtpModel.from_pretrained(model)
    mtp.eval()
    if mtp.embed_tokens is not model.model.embed_tokens or mtp.shared_head is not model.lm_head:
        raise RuntimeError("MtpModel does not share the main model's embedding / lm_head")
    if (
        not mtp.use_post_norm
        or mtp.use_shared_post_norm
        or getattr(mtp.config, "mtp_hidden_states_first", False)
    ):
        raise RuntimeError("MtpModel is not in the DeepSeek configuration (post_norm, embedding first)")
    p = f"model.layers.{n}."
    for copy, main in (
        ("shared_head.head.weight", "lm_head.weight"),
        ("embed_tokens.weight", "model.embed_tokens.weight"),
    ):
        if not np.array_equal(weights[p + copy], weights[main]):
            raise RuntimeError(f"{p}{copy} is not an exact copy of {main}")
    expected = expected_mtp_state_dict(cfg, weights)
    state = mtp.state_dict()
    if set(state) != set(expected):
        raise RuntimeError(
            f"MtpModel keys differ: model-only {sorted(set(state) - set(expected))}, "
            f"checkpoint-only {sorted(set(expected) - set(state))}"
        )
    for k, ref in expected.items():
        got = state[k].detach().cpu()
        if (
            got.dtype != torch.float32
            or tuple(got.shape) != ref.shape
            or not np.array_equal(got.numpy(), ref)
        ):
            raise RuntimeError(f"MtpModel {k}: loaded tensor differs from the checkpoint")
    return mtp


def run_mtp_reference(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, input_ids: np.ndarray, h_post: np.ndarray
) -> dict[str, Any]:
    """MTP layer over positions 0..T-2 (see MTP_DOC); returns the reference arrays and its router logits."""
    ids = torch.from_numpy(input_ids.astype(np.int64))
    h = torch.from_numpy(h_post)
    batch, seq = ids.shape
    layer = mtp.layers[0]
    block_out: list[torch.Tensor] = []
    router_logits: list[torch.Tensor] = []

    def positions(first: int) -> torch.Tensor:
        return torch.arange(first, first + seq - 1)[None].expand(batch, -1)

    def mtp_step(first: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = MtpCache(config=model.config.get_mtp_config())
        hidden = mtp.forward_layer(0, h[:, :-1], positions(first), cache, input_ids=ids[:, 1:])
        return hidden, mtp._project_to_logits(hidden)

    hooks = [
        layer.mtp_block.register_forward_hook(lambda _m, _i, o: block_out.append(o.detach().clone())),
        layer.mtp_block.mlp.gate.register_forward_hook(
            lambda _m, _i, o: router_logits.append(o[0].detach().clone())
        ),
    ]
    try:
        with torch.no_grad():
            hidden, logits = mtp_step(1)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        # SGLang / vLLM give the MTP row of h_i the rope position i, transformers i + 1: RoPE is relative.
        hidden_at_i, logits_at_i = mtp_step(0)
        # The drafting path of generate(use_mtp=True) (MTPCandidateGenerator) after a prefill over input_ids.
        _, draft_logits, _ = mtp(
            input_ids=ids[:, 1:],
            last_hidden_states=h[:, :-1],
            attention_mask=None,
            position_ids=positions(1),
            mtp_cache=MtpCache(config=model.config.get_mtp_config()),
        )
        renormed = layer.post_norm(block_out[0])
    if len(block_out) != 1 or not torch.equal(renormed, hidden):
        raise RuntimeError("MTP hidden state is not shared_head.norm (post_norm) of the MTP block output")
    lm = model.lm_head.weight.detach().numpy()
    if not np.allclose(logits.numpy(), hidden.numpy() @ lm.T, rtol=1e-5, atol=1e-5):
        raise RuntimeError("MTP logits are not lm_head(mtp_hidden)")
    shift_err = max_rel_err(logits_at_i.numpy(), logits.numpy().astype(np.float64))
    shift_err = max(shift_err, max_rel_err(hidden_at_i.numpy(), hidden.numpy().astype(np.float64)))
    if shift_err > 1e-5:
        raise RuntimeError(f"MTP output depends on the absolute rope offset (rel. err {shift_err})")
    draft_err = max_rel_err(draft_logits[:, 0].numpy(), logits[:, -1].numpy().astype(np.float64))
    if draft_err > 1e-5:
        raise RuntimeError(f"MtpModel.forward (drafting path) disagrees with forward_layer ({draft_err})")
    return {
        "mtp_logits": logits.numpy().astype(np.float32),
        "mtp_hidden": hidden.numpy().astype(np.float32),
        "mtp_block_output": block_out[0].numpy().astype(np.float32),
        "router_logits": [r.numpy() for r in router_logits],
        "rope_shift_rel_err": shift_err,
        "draft_path_rel_err": draft_err,
    }


def save_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez, but with fixed zip timestamps so the bytes only depend on the arrays."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def check_hub_config(dst: Path, cfg: dict[str, Any]) -> None:
    """transformers must read the fixture's own config.json (MTP layer count, FP8 block) as written."""
    c = AutoConfig.from_pretrained(str(dst))
    if c.num_mtp_layers != cfg["num_nextn_predict_layers"]:
        raise RuntimeError(f"num_nextn_predict_layers read as num_mtp_layers={c.num_mtp_layers}")
    quant = cfg.get("quantization_config")
    got = getattr(c, "quantization_config", None)
    got = got.to_dict() if hasattr(got, "to_dict") else got
    if quant is not None and {k: got.get(k) for k in quant} != quant:
        raise RuntimeError(f"quantization_config read as {got}")


def build_fixture(spec: FixtureSpec, out_root: Path) -> dict[str, Any]:
    """Write one fixture directory (via a temp dir + rename) and return a summary."""
    cfg = spec.config
    has_mtp = cfg["num_nextn_predict_layers"] > 0
    weights = make_weights(cfg, spec.weight_seed, spec.kv_latent_gain)
    stored, exact = encode_weights(spec, weights)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=out_root))
    try:
        write_checkpoint(tmp, cfg, stored, spec.shards)
        storage_facts = check_stored(tmp, spec, stored, exact)
        check_hub_config(tmp, cfg)
        with tempfile.TemporaryDirectory(prefix=f"{spec.name}-float32-") as f32_dir:
            model_dir = tmp
            if spec.storage == "fp8":  # transformers runs the float32 dequantisation (a hub-layout copy)
                model_dir = Path(f32_dir)
                write_checkpoint(model_dir, float32_config(cfg), exact, 1)
            model, info = DeepseekV3ForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
            )
            model.eval()
            check_loaded(model, info, cfg, exact)
            rope_facts = check_config(model, cfg)
            mtp = load_mtp(model, cfg, exact) if has_mtp else None
        biases = [
            layer.mlp.gate.e_score_correction_bias.detach().numpy()
            for layer in model.model.layers
            if hasattr(layer.mlp, "gate")
        ]
        if mtp is not None:
            biases.append(mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.detach().numpy())

        rng = np.random.default_rng(spec.input_seed)
        attempt = 0
        mtp_ref: dict[str, Any] = {}
        for attempt in range(1, MAX_INPUT_TRIES + 1):  # noqa: B007 - reported below
            input_ids = rng.integers(0, cfg["vocab_size"], size=(BATCH, spec.seq_len), dtype=np.int64)
            ref = run_reference(model, input_ids)
            router = ref["router_logits"]
            if mtp is not None:
                mtp_ref = run_mtp_reference(model, mtp, input_ids, ref["last_hidden_post_norm"])
                router = router + mtp_ref["router_logits"]
            margins = [routing_margin(r, b, cfg) for r, b in zip(router, biases, strict=True)]
            if min(margins, default=math.inf) < ROUTING_MARGIN:
                continue
            greedy = run_greedy(model, input_ids, biases, cfg)
            if greedy is not None:
                break
        else:
            raise RuntimeError(
                f"{spec.name}: no input draw with routing margins >= {ROUTING_MARGIN} and clear greedy picks"
            )

        checked = {"logits": ref["logits"], "last_hidden_post_norm": ref["last_hidden_post_norm"]}
        checked.update({k: v for k, v in mtp_ref.items() if k.startswith("mtp_")})
        for name, logits in checked.items():
            if not name.endswith("logits"):
                continue
            top1 = logits.argmax(-1)
            n_top1 = len(np.unique(top1))
            if float(logits.std(-1).min()) < 0.3 or n_top1 < 5:
                std = float(logits.std(-1).min())
                raise RuntimeError(f"{spec.name}: degenerate {name} (min std {std}, {n_top1} distinct top-1)")
        independent = np_reference(exact, cfg, input_ids, ref["last_hidden_post_norm"] if has_mtp else None)
        np_err = {k: max_rel_err(v, independent[k]) for k, v in checked.items()}
        if max(np_err.values()) > 1e-4:
            raise RuntimeError(f"{spec.name}: transformers and the float64 numpy forward disagree: {np_err}")

        arrays = {
            "input_ids": input_ids.astype(np.int32),
            "logits": ref["logits"],
            "hidden_states": ref["hidden_states"],
            "hidden_states_doc": np.array([HIDDEN_STATES_DOC]),
            "last_hidden_post_norm": ref["last_hidden_post_norm"],
            "layer_outputs": ref["layer_outputs"],
            "greedy": greedy.astype(np.int32),
            "prompt_length": np.int32(greedy.shape[1] - GREEDY_NEW),
            "new_tokens": np.int32(GREEDY_NEW),
        }
        if mtp is not None:
            arrays.update(
                {
                    "mtp_logits": mtp_ref["mtp_logits"],
                    "mtp_hidden": mtp_ref["mtp_hidden"],
                    "mtp_block_output": mtp_ref["mtp_block_output"],
                    "mtp_doc": np.array([MTP_DOC]),
                }
            )
        save_npz_deterministic(tmp / "reference.npz", arrays)
        final = out_root / spec.name
        if final.exists():
            shutil.rmtree(final)
        for f in tmp.iterdir():  # safetensors writes 0600 files; make them ordinary repo files
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in final.iterdir())
    ckpt = sum(f.stat().st_size for f in final.glob("*.safetensors"))
    logits = ref["logits"]
    return {
        "name": spec.name,
        "description": spec.description,
        "seq_len": spec.seq_len,
        "input_draws": attempt,
        "min_routing_margin": min(margins, default=math.inf),
        "n_params": int(sum(a.size for a in weights.values())),
        "checkpoint_bytes": ckpt,
        "dir_bytes": size,
        "logit_std": float(logits.std()),
        "distinct_top1": len(np.unique(logits.argmax(-1))),
        "rope": rope_facts,
        "numpy_rel_err": np_err,
        "storage": storage_facts,
        "mtp": {k: v for k, v in mtp_ref.items() if k.endswith("_err")},
    }


def fixture_facts(spec: FixtureSpec, out_root: Path) -> dict[str, Any]:
    """README row facts read back from a fixture directory: parameters (no scales) and checkpoint bytes."""
    files = sorted((out_root / spec.name).glob("*.safetensors"))
    n_params = 0
    for f in files:
        for key, h in safetensors_header(f).items():
            if key != "__metadata__" and not key.endswith("_scale_inv"):
                n_params += math.prod(h["shape"])
    return {"n_params": n_params, "checkpoint_bytes": sum(f.stat().st_size for f in files)}


def write_readme(out_root: Path) -> None:
    """Short README next to the fixtures, its table read back from the fixture directories on disk."""
    lines = [
        "# transformers parity fixtures (DeepSeek-V3)",
        "",
        "Tiny random DeepSeek-V3 checkpoints in the exact Hugging Face hub layout (hub-style `config.json`",
        "with `rope_scaling`; float32 safetensors, except `sharded_mtp_bf16` (BF16) and `fp8_mtp` (DeepSeek",
        "block FP8); one file, or shards plus `model.safetensors.index.json`) plus `reference.npz` = outputs",
        "of `transformers.DeepseekV3ForCausalLM` (float32, eager attention, 1 CPU thread) for a",
        "teacher-forced forward over `input_ids` [2, T]; the BF16 / FP8 fixtures are run as their exact",
        "float32 upcast / dequantisation. Do not edit; regenerate with:",
        "",
        "    pip install -e .[parity]   # torch (CPU) + transformers>=5",
        "    python scripts/make_parity_fixtures.py --out tests/fixtures/parity [--only NAME ...]",
        "",
        f"Generated with transformers {transformers.__version__}, torch {torch.__version__}, "
        f"numpy {np.__version__}. The script is deterministic (byte-identical output).",
        "",
        "| fixture | what it exercises | T | params | checkpoint bytes |",
        "|---|---|---|---|---|",
    ]
    for spec in SPECS:
        f = fixture_facts(spec, out_root)
        row = [f"`{spec.name}`", spec.description, spec.seq_len, f["n_params"], f["checkpoint_bytes"]]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    lines += [
        "",
        "`reference.npz`: `input_ids` int32 [B,T]; `logits` float32 [B,T,V]; `hidden_states` float32",
        "[L+1,B,T,H]; `hidden_states_doc` (str); `last_hidden_post_norm` float32 [B,T,H]; `layer_outputs`",
        "float32 [L,B,T,H] (raw residual-stream output of each decoder layer); `greedy` int32 [B,P+N]:",
        "`generate(input_ids[:, :P], max_new_tokens=N, do_sample=False)` with P = `prompt_length` = T // 2,",
        f"N = `new_tokens` = {GREEDY_NEW}, no EOS (every greedy choice at least {GREEDY_GAP} above the",
        "runner-up, every routing decision along it beyond the margin). Fixtures with an MTP layer",
        "(`num_nextn_predict_layers: 1`) add `mtp_logits` float32 [B,T-1,V], `mtp_hidden` float32",
        "[B,T-1,H] (after `shared_head.norm`), `mtp_block_output` float32 [B,T-1,H] (before it) and",
        "`mtp_doc` (str).",
        "",
        "Conventions pinned by the generator (it aborts if transformers ever behaves differently):",
        "",
        f"- {HIDDEN_STATES_DOC}",
        "- RoPE: `rope_interleave` defaults to true, i.e. the rope dims of q/k are interleaved pairs",
        "  (x0,x1),(x2,x3),... each rotated by one frequency (DeepSeek's original layout); transformers",
        "  returns them de-interleaved ([evens, odds]) for both q and k, which leaves q.k unchanged.",
        "- YaRN: inv_freq uses floor/ceil-truncated correction range (beta_fast/beta_slow over",
        "  original_max_position_embeddings); cos and sin are multiplied by mscale(factor, mscale) /",
        "  mscale(factor, mscale_all_dim) (= 1 for the real V3 values), and the softmax scale",
        "  (qk_nope+qk_rope)^-0.5 is multiplied by mscale(factor, mscale_all_dim)^2, where",
        "  mscale(s, m) = 0.1 m ln(s) + 1. YaRN is applied at every position, not only beyond",
        "  original_max_position_embeddings.",
        "- q_a_layernorm and kv_a_layernorm use eps 1e-6 regardless of `rms_norm_eps`.",
        f"- Every MoE routing decision (group and expert choice) has a margin >= {ROUTING_MARGIN} in",
        "  sigmoid-score units, so a float32 implementation should pick exactly the same experts (the",
        "  MTP layer's router included).",
        "- Every reference is also recomputed by an independent float64 numpy forward of the DeepSeek",
        "  equations (relative error < 1e-4 required, ~1e-6 observed).",
        f"- MTP: {MTP_DOC}",
        "- MTP keys: `model.layers.{N}.` holds a full MoE decoder layer plus `enorm`, `hnorm`, `eh_proj`",
        "  [H, 2H], `shared_head.norm`, `shared_head.head` (an exact copy of `lm_head.weight`) and",
        "  `embed_tokens` (an exact copy of `model.embed_tokens.weight`). `DeepseekV3ForCausalLM` leaves",
        "  them all unloaded (reported as unexpected); transformers' `MtpModel` maps `shared_head.norm` to",
        "  `post_norm` and uses the main model's embedding and lm_head instead of the copies.",
    ]
    for spec in SPECS:
        lines += [f"- `{spec.name}`: {note}" for note in spec.notes]
    (out_root / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output root (default {DEFAULT_OUT})")
    ap.add_argument("--only", nargs="*", default=None, help="build only these fixtures")
    args = ap.parse_args(argv)
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        sys.stderr.write(f"transformers>=5 is required, found {transformers.__version__}\n")
        return 2

    transformers.logging.set_verbosity_error()  # the MTP layer's keys are reported as unexpected on purpose
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = [s for s in SPECS if args.only is None or s.name in args.only]
    if args.only:
        missing = set(args.only) - {s.name for s in specs}
        if missing:
            ap.error(f"unknown fixtures {sorted(missing)}; known: {[s.name for s in SPECS]}")
    summaries = []
    for spec in specs:
        summary = build_fixture(spec, args.out)
        summaries.append(summary)
        r = summary["rope"]
        print(
            f"{summary['name']:>20}: {summary['n_params']} params, ckpt {summary['checkpoint_bytes']} B, "
            f"dir {summary['dir_bytes']} B, T={summary['seq_len']}, draws={summary['input_draws']}, "
            f"routing margin {summary['min_routing_margin']:.4f}, logit std {summary['logit_std']:.3f}, "
            f"{summary['distinct_top1']} distinct top-1"
        )
        print(
            f"{'':>20}  rope_type={r['rope_type']} inv_freq={[round(x, 6) for x in r['inv_freq']]} "
            f"cos/sin factor={r['cos_sin_attention_factor']:.6f} softmax scale={r['softmax_scale']:.6f} "
            f"(plain {r['softmax_scale_without_mscale']:.6f})"
        )
        st, errs = summary["storage"], {**summary["numpy_rel_err"], **summary["mtp"]}
        print(
            f"{'':>20}  dtypes {st['dtypes']}, {st['fp8_weights']} fp8 weights (min block-scale ratio "
            f"{st['fp8_min_scale_ratio']:.2f}); rel. err vs float64 numpy / checks: "
            + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        )
    absent = [spec.name for spec in SPECS if not (args.out / spec.name).is_dir()]
    if absent:
        print(f"README.md not rewritten: fixtures {absent} are not in {args.out}")
    else:
        write_readme(args.out)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
