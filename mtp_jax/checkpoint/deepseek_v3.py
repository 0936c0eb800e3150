"""Hub-layout DeepSeek-V3 tensors -> the parameter pytree of :mod:`mtp_jax.models.deepseek_v3`.

Hub weights are [out, in] (``nn.Linear``); ours are [in, out], with per-head axes split out and
the layers of each stack (dense, MoE) stacked along a leading axis.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import DeepseekV3Config
from mtp_jax.errors import CheckpointError

log = logging.getLogger(__name__)

_FLOAT_KINDS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype("bfloat16"), np.dtype(np.float64)}


class _Tensors:
    """Reads hub tensors by key with shape checks; remembers which keys were used."""

    def __init__(self, reader: CheckpointReader, cfg: DeepseekV3Config) -> None:
        self.reader = reader
        self.cfg = cfg
        self.used: set[str] = set()

    def get(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in self.reader:
            raise CheckpointError(f"checkpoint {self.reader.directory} is missing tensor '{key}'")
        got = self.reader.shape(key)
        if got != shape:
            raise CheckpointError(
                f"tensor '{key}' has shape {list(got)} but config.json implies {list(shape)}"
            )
        dtype = self.reader.dtype(key)
        if dtype.name.startswith("float8"):
            raise CheckpointError(
                f"tensor '{key}' is {dtype.name}: FP8 block-quantised weights are not loadable yet "
                "(only BF16/FP16/FP32 safetensors)"
            )
        if dtype not in _FLOAT_KINDS:
            raise CheckpointError(f"tensor '{key}' has dtype {dtype}, expected a floating-point type")
        self.used.add(key)
        return self.reader.get(key).astype(np.float32)

    def linear(self, key: str, out_dim: int, in_dim: int) -> np.ndarray:
        return self.get(key, (out_dim, in_dim)).T


def _attention(t: _Tensors, pre: str) -> dict[str, np.ndarray]:
    c = t.cfg
    d, h = c.hidden_size, c.num_attention_heads
    p: dict[str, np.ndarray] = {}
    if c.q_lora_rank is None:
        p["q"] = t.linear(f"{pre}q_proj.weight", h * c.qk_head_dim, d).reshape(d, h, c.qk_head_dim)
    else:
        r = c.q_lora_rank
        p["q_a"] = t.linear(f"{pre}q_a_proj.weight", r, d)
        p["q_a_norm"] = t.get(f"{pre}q_a_layernorm.weight", (r,))
        p["q_b"] = t.linear(f"{pre}q_b_proj.weight", h * c.qk_head_dim, r).reshape(r, h, c.qk_head_dim)
    p["kv_a"] = t.linear(f"{pre}kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d)
    p["kv_a_norm"] = t.get(f"{pre}kv_a_layernorm.weight", (c.kv_lora_rank,))
    kv_b = t.linear(f"{pre}kv_b_proj.weight", h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    kv_b = kv_b.reshape(c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim)
    p["k_b"] = kv_b[..., : c.qk_nope_head_dim]
    p["v_b"] = kv_b[..., c.qk_nope_head_dim :]
    p["o"] = t.linear(f"{pre}o_proj.weight", d, h * c.v_head_dim).reshape(h, c.v_head_dim, d)
    return p


def _swiglu(t: _Tensors, pre: str, d: int, f: int) -> dict[str, np.ndarray]:
    return {
        "gate": t.linear(f"{pre}gate_proj.weight", f, d),
        "up": t.linear(f"{pre}up_proj.weight", f, d),
        "down": t.linear(f"{pre}down_proj.weight", d, f),
    }


def _moe(t: _Tensors, pre: str) -> dict[str, np.ndarray]:
    c = t.cfg
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts
    experts = [_swiglu(t, f"{pre}experts.{i}.", d, f) for i in range(e)]
    p = {
        "router": t.linear(f"{pre}gate.weight", e, d),
        "bias": t.get(f"{pre}gate.e_score_correction_bias", (e,)),
        **{name: np.stack([x[name] for x in experts]) for name in ("gate", "up", "down")},
    }
    if c.n_shared_experts:
        shared = _swiglu(t, f"{pre}shared_experts.", d, f * c.n_shared_experts)
        p.update({f"shared_{k}": v for k, v in shared.items()})
    return p


def _layer(t: _Tensors, i: int) -> dict:
    pre = f"model.layers.{i}."
    d = t.cfg.hidden_size
    is_moe = i >= t.cfg.first_k_dense_replace
    return {
        "input_norm": t.get(f"{pre}input_layernorm.weight", (d,)),
        "post_attn_norm": t.get(f"{pre}post_attention_layernorm.weight", (d,)),
        "attn": _attention(t, f"{pre}self_attn."),
        "mlp": _moe(t, f"{pre}mlp.") if is_moe else _swiglu(t, f"{pre}mlp.", d, t.cfg.intermediate_size),
    }


def _stack(layers: list[dict], convert: Callable[[tuple[str, ...], np.ndarray], object]) -> dict:
    def walk(path: tuple[str, ...], items: list) -> object:
        if isinstance(items[0], dict):
            return {k: walk(path + (k,), [x[k] for x in items]) for k in items[0]}
        return convert(path, np.stack(items))

    return walk((), layers)  # type: ignore[return-value]


def load_params(reader: CheckpointReader, cfg: DeepseekV3Config, dtype: jnp.dtype) -> dict:
    """Read every target-model tensor of a hub checkpoint into the parameter pytree.

    Router weights and correction biases stay float32 whatever ``dtype`` is; everything else is
    cast to ``dtype``. Tensors of the MTP layers (index >= num_hidden_layers) are left to the draft.
    """
    t = _Tensors(reader, cfg)
    d, v = cfg.hidden_size, cfg.vocab_size

    def convert(path: tuple[str, ...], x: np.ndarray) -> object:
        keep_f32 = path[-1] in ("router", "bias")
        return jnp.asarray(x, jnp.float32 if keep_f32 else dtype)

    params: dict = {"embed": convert(("embed",), t.get("model.embed_tokens.weight", (v, d)))}
    first = 0
    for name, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)):
        if n:
            params[name] = _stack([_layer(t, i) for i in range(first, first + n)], convert)
        first += n
    params["final_norm"] = convert(("final_norm",), t.get("model.norm.weight", (d,)))
    if "lm_head.weight" in reader or not cfg.tie_word_embeddings:
        params["lm_head"] = convert(("lm_head",), t.linear("lm_head.weight", v, d))
    else:
        params["lm_head"] = params["embed"].T
    _report_unused(reader, t.used, cfg)
    return params


def _report_unused(reader: CheckpointReader, used: set[str], cfg: DeepseekV3Config) -> None:
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    unexpected = []
    for key in reader.keys():
        if key in used:
            continue
        m = mtp.match(key)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # MTP/NextN layers belong to the draft
        unexpected.append(key)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        log.warning("ignoring %d unexpected tensors in %s: %s", len(unexpected), reader.directory, shown)
