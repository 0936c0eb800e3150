"""Generate tiny random DeepSeek-V3 checkpoints plus transformers reference outputs (parity fixtures).

Each fixture directory ``<out>/<name>/`` holds a checkpoint in the exact Hugging Face hub layout
(``config.json`` written with the hub's field names, i.e. ``rope_scaling`` rather than transformers-5's
``rope_parameters``; float32 safetensors, one file or two shards plus ``model.safetensors.index.json``) and a
``reference.npz`` produced by ``transformers.DeepseekV3ForCausalLM`` (float32,
``attn_implementation="eager"``, single CPU thread) on a teacher-forced forward pass over ``input_ids``.

``reference.npz`` arrays:

* ``input_ids``             int32   [B, T]
* ``logits``                float32 [B, T, V]  full logits of the forward pass
* ``hidden_states``         float32 [L+1, B, T, H]  ``output_hidden_states=True`` tuple, stacked (see below)
* ``hidden_states_doc``     str     [1]  the convention below, in words
* ``last_hidden_post_norm`` float32 [B, T, H]  ``model.model(input_ids).last_hidden_state``
* ``layer_outputs``         float32 [L, B, T, H]  raw output (residual stream, before any final norm) of every
  decoder layer, captured with forward hooks

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
recomputation, and inputs are re-drawn until every MoE routing decision has a safe margin, so that a correct
float32 implementation cannot flip an expert or group choice through rounding.

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
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
    import transformers
    from safetensors.numpy import save_file
    from transformers import DeepseekV3ForCausalLM
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

HIDDEN_STATES_DOC = (
    "hidden_states[k], k=0..L (L=num_hidden_layers), from transformers "
    f"{transformers.__version__} DeepseekV3ForCausalLM(output_hidden_states=True): k=0 is the token "
    "embedding (input of layer 0); 1<=k<L is the output of decoder layer k-1 (residual stream, no norm); "
    "k=L is the output of the last decoder layer AFTER the final model.norm RMSNorm, i.e. equal to "
    "last_hidden_post_norm (the pre-norm output of the last layer is layer_outputs[L-1])."
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
]


# --------------------------------------------------------------------------------------------------- weights


def make_weights(cfg: dict[str, Any], seed: int, kv_latent_gain: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 weights in hub layout (nn.Linear [out, in]); iteration order is the write order.

    ``kv_latent_gain`` scales the kv_lora rows of ``kv_a_proj_with_mqa`` (the part that only feeds
    ``kv_a_layernorm``); a small gain makes the latent's variance small enough for that norm's eps to matter.
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
    w["model.embed_tokens.weight"] = rng.standard_normal((cfg["vocab_size"], hid)).astype(np.float32)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
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
        if i < cfg["first_k_dense_replace"]:
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
    w["model.norm.weight"] = norm(hid)
    w["lm_head.weight"] = linear(cfg["vocab_size"], hid, gain=2.0)
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


# --------------------------------------------------------------------------------------------------- checks


def expected_state_dict(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What transformers' module state_dict must hold: hub keys with the experts fused per layer."""
    out: dict[str, np.ndarray] = {}
    for k, v in weights.items():
        if ".mlp.experts." not in k:
            out[k] = v
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        n_exp = cfg["n_routed_experts"]
        out[p + "gate_up_proj"] = np.stack(
            [
                np.concatenate([weights[f"{p}{e}.gate_proj.weight"], weights[f"{p}{e}.up_proj.weight"]])
                for e in range(n_exp)
            ]
        )
        out[p + "down_proj"] = np.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(n_exp)])
    return out


def check_loaded(
    model: DeepseekV3ForCausalLM, info: dict[str, Any], cfg: dict[str, Any], weights: dict[str, np.ndarray]
) -> None:
    """Fail unless every tensor of the model equals the numpy weights bit for bit."""
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            raise RuntimeError(f"from_pretrained reported {kind}: {info[kind]}")
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


# --------------------------------------------------------------------------------------------------- forward


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


def build_fixture(spec: FixtureSpec, out_root: Path) -> dict[str, Any]:
    """Write one fixture directory (via a temp dir + rename) and return a summary."""
    cfg = spec.config
    weights = make_weights(cfg, spec.weight_seed, spec.kv_latent_gain)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=out_root))
    try:
        write_checkpoint(tmp, cfg, weights, spec.shards)
        model, info = DeepseekV3ForCausalLM.from_pretrained(
            str(tmp), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        model.eval()
        check_loaded(model, info, cfg, weights)
        rope_facts = check_config(model, cfg)
        biases = [
            layer.mlp.gate.e_score_correction_bias.detach().numpy()
            for layer in model.model.layers
            if hasattr(layer.mlp, "gate")
        ]

        rng = np.random.default_rng(spec.input_seed)
        attempt = 0
        for attempt in range(1, MAX_INPUT_TRIES + 1):  # noqa: B007 - reported below
            input_ids = rng.integers(0, cfg["vocab_size"], size=(BATCH, spec.seq_len), dtype=np.int64)
            ref = run_reference(model, input_ids)
            margins = [routing_margin(r, b, cfg) for r, b in zip(ref["router_logits"], biases, strict=True)]
            if min(margins, default=math.inf) >= ROUTING_MARGIN:
                break
        else:
            raise RuntimeError(f"{spec.name}: no input draw with routing margin >= {ROUTING_MARGIN}")

        logits = ref["logits"]
        top1 = logits.argmax(-1)
        n_top1 = len(np.unique(top1))
        if float(logits.std(-1).min()) < 0.3 or n_top1 < 5:
            std = float(logits.std(-1).min())
            raise RuntimeError(f"{spec.name}: degenerate logits (min std {std}, {n_top1} distinct top-1 ids)")

        arrays = {
            "input_ids": input_ids.astype(np.int32),
            "logits": ref["logits"],
            "hidden_states": ref["hidden_states"],
            "hidden_states_doc": np.array([HIDDEN_STATES_DOC]),
            "last_hidden_post_norm": ref["last_hidden_post_norm"],
            "layer_outputs": ref["layer_outputs"],
        }
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
        "distinct_top1": n_top1,
        "rope": rope_facts,
    }


def write_readme(out_root: Path, summaries: list[dict[str, Any]]) -> None:
    """Short README next to the fixtures (rewritten only when all fixtures are rebuilt)."""
    lines = [
        "# transformers parity fixtures (DeepSeek-V3)",
        "",
        "Tiny random DeepSeek-V3 checkpoints in the exact Hugging Face hub layout (hub-style `config.json`",
        "with `rope_scaling`, float32 safetensors, one fixture sharded with `model.safetensors.index.json`)",
        "plus `reference.npz` = outputs of `transformers.DeepseekV3ForCausalLM` (float32, eager attention,",
        "1 CPU thread) for a teacher-forced forward over `input_ids` [2, T]. Do not edit; regenerate with:",
        "",
        "    pip install -e .[parity]   # torch (CPU) + transformers>=5",
        "    python scripts/make_parity_fixtures.py --out tests/fixtures/parity",
        "",
        f"Generated with transformers {transformers.__version__}, torch {torch.__version__}, "
        f"numpy {np.__version__}. The script is deterministic (byte-identical output).",
        "",
        "| fixture | what it exercises | T | params | checkpoint bytes |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{s['name']}` | {s['description']} | {s['seq_len']} | {s['n_params']} | {s['checkpoint_bytes']} |"
        for s in summaries
    ]
    lines += [
        "",
        "`reference.npz`: `input_ids` int32 [B,T]; `logits` float32 [B,T,V]; `hidden_states` float32",
        "[L+1,B,T,H]; `hidden_states_doc` (str); `last_hidden_post_norm` float32 [B,T,H]; `layer_outputs`",
        "float32 [L,B,T,H] (raw residual-stream output of each decoder layer).",
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
        "  sigmoid-score units, so a float32 implementation should pick exactly the same experts.",
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
    if len(summaries) == len(SPECS):
        write_readme(args.out, summaries)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
