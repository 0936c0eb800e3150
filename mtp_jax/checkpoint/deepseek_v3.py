"""Hub-layout DeepSeek-V3 tensors -> the parameter pytree of :mod:`mtp_jax.targets.deepseek_v3`.

Hub weights are [out, in] (``nn.Linear``); ours are [in, out], with per-head axes split out and
the layers of each stack (dense, MoE, MTP) stacked along a leading axis.

Loading streams: :func:`param_groups` reads one group at a time (the embedding, one decoder
layer, the final norm, the head, one MTP layer) into host arrays of the target dtype, and
:func:`assemble` moves each group to the device and writes it into the preallocated stacked
arrays in place. Host memory therefore peaks near the largest group (one MoE layer), never the
whole model; the same groups are what ``mtp-jax convert`` writes.

Multi-host: with a mesh whose ``expert`` axis spans processes, each process reads only the routed
experts its own devices hold (:func:`mtp_jax.sharding.local_experts`): the stacked expert leaves
are then :class:`ExpertRows`, and :func:`assemble` builds the global arrays from the local
shards. Every other tensor is replicated, so every process reads it.

FP8 checkpoints (``quantization_config.quant_method == "fp8"``) are dequantised block-wise with
``weight_scale_inv`` (``weights="dense"``), or kept as :class:`Fp8Weight` (``weights="fp8"``).
``kv_b_proj`` is always dequantised: it is small and used in absorbed form every step.

MTP/NextN layers (``model.layers.{N + k}``) go to ``params["mtp"]``: ``enorm``, ``hnorm``,
``eh_proj`` [2d, d] (input order: embedding first, then hidden), ``head_norm`` (shared_head.norm),
``layer`` (a MoE decoder layer), and ``embed`` / ``head`` only when the checkpoint's copies differ
from the main embedding / lm_head (normally they are identical and stored once).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.loader import (
    FLOAT32_LEAVES,
    WEIGHT_MODES,
    ExpertRows,
    Group,
    GroupEmitter,
    HubTensors,
    assemble_groups,
    host_dtype,
    report_unused,
    stack_leaves,
    stack_rows,
)
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import DeepseekV3Config

__all__ = [
    "FLOAT32_LEAVES",
    "STACKED_GROUPS",
    "WEIGHT_MODES",
    "ExpertRows",
    "assemble",
    "group_sizes",
    "host_dtype",
    "load_params",
    "param_groups",
]

log = logging.getLogger(__name__)

STACKED_GROUPS = ("dense", "moe", "mtp")


def attention_tensors(t: HubTensors, pre: str, d_in: int | None = None) -> dict:
    """One MLA attention's tensors under ``pre`` (``...self_attn.``); the first projections
    (q_a / q, kv_a) read inputs of width ``d_in`` (default hidden_size; an EAGLE-3 draft's read 2H)."""
    c = t.cfg
    d, h, qk = c.hidden_size, c.num_attention_heads, c.qk_head_dim
    d_in = d if d_in is None else d_in
    p: dict = {}
    if c.q_lora_rank is None:
        p["q"] = t.linear(f"{pre}q_proj.weight", h * qk, d_in, (d_in, h, qk))
    else:
        r = c.q_lora_rank
        p["q_a"] = t.linear(f"{pre}q_a_proj.weight", r, d_in)
        p["q_a_norm"] = t.get(f"{pre}q_a_layernorm.weight", (r,))
        p["q_b"] = t.linear(f"{pre}q_b_proj.weight", h * qk, r, (r, h, qk))
    p["kv_a"] = t.linear(f"{pre}kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d_in)
    p["kv_a_norm"] = t.get(f"{pre}kv_a_layernorm.weight", (c.kv_lora_rank,))
    nope_v = c.qk_nope_head_dim + c.v_head_dim
    kv_b = t.linear(
        f"{pre}kv_b_proj.weight", h * nope_v, c.kv_lora_rank, (c.kv_lora_rank, h, nope_v), dense=True
    )
    p["k_b"] = np.ascontiguousarray(kv_b[..., : c.qk_nope_head_dim])
    p["v_b"] = np.ascontiguousarray(kv_b[..., c.qk_nope_head_dim :])
    p["o"] = t.linear(f"{pre}o_proj.weight", d, h * c.v_head_dim, (h, c.v_head_dim, d))
    return p


def swiglu_tensors(t: HubTensors, pre: str, d: int, f: int) -> dict:
    return {
        "gate": t.linear(f"{pre}gate_proj.weight", f, d),
        "up": t.linear(f"{pre}up_proj.weight", f, d),
        "down": t.linear(f"{pre}down_proj.weight", d, f),
    }


def _moe(t: HubTensors, pre: str) -> dict:
    c = t.cfg
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts

    def expert(i: int) -> dict:
        return swiglu_tensors(t, f"{pre}experts.{i}.", d, f)

    experts = stack_leaves(expert, e) if t.experts is None else stack_rows(expert, t.experts, e)
    p = {
        "router": np.ascontiguousarray(t.get(f"{pre}gate.weight", (e, d), np.float32).T),
        "bias": t.get(f"{pre}gate.e_score_correction_bias", (e,), np.float32),
        **experts,
    }
    if c.n_shared_experts:
        shared = swiglu_tensors(t, f"{pre}shared_experts.", d, f * c.n_shared_experts)
        p.update({f"shared_{k}": v for k, v in shared.items()})
    return p


def _layer(t: HubTensors, i: int) -> dict:
    pre = f"model.layers.{i}."
    d = t.cfg.hidden_size
    is_moe = i >= t.cfg.first_k_dense_replace
    return {
        "input_norm": t.get(f"{pre}input_layernorm.weight", (d,)),
        "post_attn_norm": t.get(f"{pre}post_attention_layernorm.weight", (d,)),
        "attn": attention_tensors(t, f"{pre}self_attn."),
        "mlp": _moe(t, f"{pre}mlp.")
        if is_moe
        else swiglu_tensors(t, f"{pre}mlp.", d, t.cfg.intermediate_size),
    }


def _mtp_layer(t: HubTensors, k: int) -> dict:
    cfg = t.cfg
    n = cfg.num_hidden_layers + k
    pre = f"model.layers.{n}."
    d, v = cfg.hidden_size, cfg.vocab_size
    p = {
        "enorm": t.get(f"{pre}enorm.weight", (d,)),
        "hnorm": t.get(f"{pre}hnorm.weight", (d,)),
        "eh_proj": t.linear(f"{pre}eh_proj.weight", d, 2 * d),
        "head_norm": t.get(f"{pre}shared_head.norm.weight", (d,)),
        "layer": _layer(t, n),
    }
    main_head = "lm_head.weight" if "lm_head.weight" in t.reader else "model.embed_tokens.weight"
    for name, key, main in (
        ("embed", f"{pre}embed_tokens.weight", "model.embed_tokens.weight"),
        ("head", f"{pre}shared_head.head.weight", main_head),
    ):
        if key not in t.reader:
            continue  # absent copies mean "shared with the main model"
        if t.same(key, main):
            t._check(key, (v, d))
            continue
        log.info("%s differs from %s; keeping a separate copy for the MTP layer", key, main)
        p[name] = t.get(key, (v, d)) if name == "embed" else np.ascontiguousarray(t.get(key, (v, d)).T)
    return p


def param_groups(
    reader: CheckpointReader,
    cfg: DeepseekV3Config,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    skip: Mapping[tuple[str, int | None], list[str]] | None = None,
    experts: Sequence[int] | None = None,
) -> Iterator[tuple[Group, list[str]]]:
    """Yield ((name, index, host pytree), hub keys consumed) one group at a time, in a fixed order.

    Groups in ``skip`` (mapped to the keys they consumed before, e.g. by an interrupted conversion)
    are yielded with a ``None`` tree and not read. ``experts`` (None: all) restricts the routed
    experts read in every MoE layer, MTP included, to those ids; the stacked expert leaves are then
    :class:`ExpertRows`. After the last group, tensors nobody asked for (other than the experts
    left out) are reported: a warning, or with ``strict`` a :class:`CheckpointError` naming them.
    """
    t = HubTensors(reader, cfg, dtype, weights, experts)
    d, v = cfg.hidden_size, cfg.vocab_size
    emit = GroupEmitter(t, skip)

    yield emit("embed", None, lambda: t.get("model.embed_tokens.weight", (v, d)))
    for i in range(cfg.num_hidden_layers):
        if i < cfg.first_k_dense_replace:
            yield emit("dense", i, lambda i=i: _layer(t, i))
        else:
            yield emit("moe", i - cfg.first_k_dense_replace, lambda i=i: _layer(t, i))
    yield emit("final_norm", None, lambda: t.get("model.norm.weight", (d,)))
    if "lm_head.weight" in reader or not cfg.tie_word_embeddings:
        yield emit("lm_head", None, lambda: np.ascontiguousarray(t.linear("lm_head.weight", v, d)))
    if mtp:
        for k in range(cfg.num_nextn_predict_layers):
            yield emit("mtp", k, lambda k=k: _mtp_layer(t, k))
    layer_key = re.compile(r"model\.layers\.(\d+)\.")
    expert_key = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    mtp_layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)

    def left_out(key: str) -> bool:
        m = layer_key.match(key)
        if not mtp and m and int(m.group(1)) in mtp_layers:
            return True  # MTP layers were not asked for
        e = expert_key.match(key) if t.experts is not None else None
        return bool(e) and int(e.group(1)) not in t.experts  # another host's experts

    report_unused(reader, emit.used, strict=strict, left_out=left_out, logger=log)


def group_sizes(cfg: DeepseekV3Config, mtp: bool = True) -> dict[str, int]:
    sizes = {
        "dense": cfg.num_dense_layers,
        "moe": cfg.num_moe_layers,
        "mtp": cfg.num_nextn_predict_layers if mtp else 0,
    }
    return {k: n for k, n in sizes.items() if n}


def load_params(
    reader: CheckpointReader,
    cfg: DeepseekV3Config,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Read a hub checkpoint into device parameters (see the module docstring). With a mesh, this
    process reads only the routed experts its devices hold."""
    from mtp_jax.sharding import local_experts

    experts = None if mesh is None else local_experts(mesh, cfg.n_routed_experts)
    groups = (
        g
        for g, _ in param_groups(reader, cfg, dtype, weights=weights, mtp=mtp, strict=strict, experts=experts)
    )
    return assemble(groups, cfg, dtype, mtp=mtp, mesh=mesh)


def assemble(
    groups: Iterator[Group],
    cfg: DeepseekV3Config,
    dtype: Any = None,
    *,
    mtp: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Device parameters from groups (:func:`mtp_jax.checkpoint.loader.assemble_groups`); a tied
    head is stored as ``lm_head`` = the embedding's transpose."""
    return assemble_groups(groups, group_sizes(cfg, mtp), mesh=mesh, copy_tied_head=True)
