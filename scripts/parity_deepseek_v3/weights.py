"""Random DeepSeek-V3 weights in the hub layout, written as float32, BF16 or DeepSeek block FP8, and
the check that the written files hold exactly what was meant."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from .specs import FP8_BLOCK, FP8_KEY, FP8_MAX, FixtureSpec

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
