"""EAGLE-3 draft checkpoints -> ``params["eagle3"]`` (:mod:`mtp_jax.drafts.eagle3.draft`).

Published producers name the same tensors three ways (docs/formats.md, "EAGLE-3 drafts"): the decoder
layer under ``midlayer.`` (EAGLE, SpecForge, SGLang), ``layers.0.`` (vLLM, NVIDIA) or
``model.layers.0.`` (NeMo, which also prefixes ``fc``, ``embed_tokens`` and the norm with
``model.``). A checkpoint must use one of them throughout; a mix is refused, as is anything that
does not fit the target it is loaded beside (the target's hidden width and vocabulary, its layers).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.checkpoint.loader import HubTensors, assemble_groups, read_vocab_map, report_unused
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import describe_capture
from mtp_jax.drafts.eagle3.config import Eagle3Config, eagle3_capture, parse_eagle3_config
from mtp_jax.errors import CheckpointError, ConfigError
from mtp_jax.targets.deepseek_v3.checkpoint import attention_tensors, swiglu_tensors
from mtp_jax.targets.llama.checkpoint import decoder_layer_tensors

log = logging.getLogger(__name__)

LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
# An MLA draft (SGLang's Eagle3DeepseekV2ForCausalLM, MAX's Eagle3DeepseekV3) is told by its keys.
_MLA_KEYS = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")


def is_eagle3(raw: dict, reader: CheckpointReader) -> bool:
    """Whether a draft directory holds an EAGLE-3 draft: its architecture says so, or it has the
    fusion layer ``fc`` over target features."""
    archs = raw.get("architectures") or []
    return any("eagle3" in str(a).lower() for a in archs) or any(
        k in reader for k in ("fc.weight", "model.fc.weight")
    )


class _Keys:
    """Resolves the dialect's key names and refuses mixes."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        found = [p for p in LAYER_PREFIXES if any(k.startswith(p) for k in reader.keys())]
        if not found:
            raise CheckpointError(
                f"{reader.directory}: no EAGLE-3 decoder layer found (expected tensors under one of "
                f"{', '.join(LAYER_PREFIXES)})"
            )
        if len(found) > 1:
            raise CheckpointError(
                f"{reader.directory}: the checkpoint mixes EAGLE-3 key dialects ({', '.join(found)}); "
                "a draft must use one throughout"
            )
        self.layer = found[0]

    def top(self, name: str, required: bool = True) -> str | None:
        """The stored key of a top-level tensor: ``name`` or ``model.name`` (never both)."""
        have = [k for k in (name, f"model.{name}") if k in self.reader]
        if len(have) > 1:
            raise CheckpointError(
                f"{self.reader.directory}: both '{have[0]}' and '{have[1]}' are present (mixed key dialects)"
            )
        if not have:
            if required:
                raise CheckpointError(f"EAGLE-3 draft {self.reader.directory} is missing tensor '{name}'")
            return None
        return have[0]


def _layer(t: HubTensors, keys: _Keys, c: Eagle3Config) -> dict:
    h, f = c.hidden_size, c.intermediate_size
    pre = keys.layer
    if c.mla is None:
        layer = decoder_layer_tensors(
            t, pre, h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, f, d_in=2 * h
        )
    else:
        mla = HubTensors(t.reader, c.mla, t.dtype)  # the MLA key map reads its widths from cfg.mla
        layer = {
            "input_norm": t.get(f"{pre}input_layernorm.weight", (h,)),
            "post_attn_norm": t.get(f"{pre}post_attention_layernorm.weight", (h,)),
            "attn": attention_tensors(mla, pre, d_in=2 * h),
            "mlp": swiglu_tensors(t, f"{pre}mlp.", h, f),
        }
        t.used += mla.used
    return {"hidden_norm": t.get(f"{pre}hidden_norm.weight", (h,)), **layer}


def _vocab_map(reader: CheckpointReader, keys: _Keys, c: Eagle3Config, used: set[str]) -> np.ndarray | None:
    """Target id of each draft id (int32 [Vd]) from ``d2t`` offsets, checked against ``t2d``; None
    when draft ids are target ids."""
    d2t_key, t2d_key = keys.top("d2t", required=False), keys.top("t2d", required=False)
    return read_vocab_map(reader, d2t_key, t2d_key, c.draft_vocab_size, c.vocab_size, used)


def load_eagle3(
    reader: CheckpointReader,
    raw: dict,
    target_cfg: Any,
    target_params: dict,
    dtype: Any,
    *,
    layer_ids: str = "inputs",
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    verbose: bool = True,
) -> tuple[Eagle3Config, dict]:
    """Read an EAGLE-3 draft (its tensors: ``reader``; its parsed config.json: ``raw``) for the target
    ``target_cfg`` (whose device parameters are ``target_params``). Returns (config with its
    captured layers resolved, ``params["eagle3"]``).

    ``layer_ids``: how the config's ``eagle_aux_hidden_state_layer_ids`` are read ("inputs": id i is
    the input of target layer i, as vLLM reads them; "outputs": the output of layer i, as SGLang
    does). The resolved layers are printed (``verbose``) and logged."""
    path = reader.directory
    keys = _Keys(reader)
    cfg = parse_eagle3_config(raw, mla=any(f"{keys.layer}{k}" in reader for k in _MLA_KEYS))
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(
            f"{path}: the EAGLE-3 draft's vocab_size is {cfg.vocab_size}, the target's "
            f"{target_cfg.vocab_size}"
        )
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ConfigError(
            f"{path}: the EAGLE-3 draft reads target hidden states of width {cfg.target_hidden_size} "
            f"(target_hidden_size), but the target's hidden_size is {target_cfg.hidden_size}"
        )
    capture = eagle3_capture(cfg, target_cfg.num_hidden_layers, layer_ids)
    cfg = dataclasses.replace(cfg, capture=capture)
    fc_key = keys.top("fc.weight")
    width = len(capture) * cfg.target_hidden_size
    if reader.shape(fc_key) != (cfg.hidden_size, width):
        raise CheckpointError(
            f"tensor '{fc_key}' has shape {list(reader.shape(fc_key))}, but fusing {len(capture)} target "
            f"layers of width {cfg.target_hidden_size} into hidden_size {cfg.hidden_size} needs "
            f"[{cfg.hidden_size}, {width}]"
        )
    t = HubTensors(reader, cfg, dtype)
    h = cfg.hidden_size
    tree = {"fc": t.linear(fc_key, h, width), **_layer(t, keys, cfg)}
    tree["norm"] = t.get(keys.top("norm.weight"), (h,))
    tree["lm_head"] = np.ascontiguousarray(t.linear(keys.top("lm_head.weight"), cfg.draft_vocab_size, h))
    used = set(t.used)
    vocab_map = _vocab_map(reader, keys, cfg, used)
    if vocab_map is not None:
        tree["draft_to_target"] = vocab_map
    embed_key = keys.top("embed_tokens.weight", required=False)
    if embed_key is not None:
        embed = t.get(embed_key, (cfg.vocab_size, h))
        used.add(embed_key)
        if not _same_as_target(embed, target_params["embed"]):
            tree["embed"] = embed
    elif h != target_cfg.hidden_size:
        raise CheckpointError(
            f"{path}: the draft has no embed_tokens.weight, so it would use the target's embedding "
            f"(width {target_cfg.hidden_size}), but its hidden_size is {h}"
        )
    report_unused(reader, used, strict=strict, logger=log)
    how = "as written in its config" if cfg.aux_layer_ids is not None else "by default"
    note = (
        f"EAGLE-3 draft {path}: reads target {describe_capture(capture)} ({how}"
        + (f": ids {list(cfg.aux_layer_ids)} read as layer {layer_ids}" if cfg.aux_layer_ids else "")
        + ")"
    )
    log.info(note)
    if verbose:
        print(note, file=sys.stderr)
    return cfg, assemble_groups([("eagle3", None, tree)], {}, mesh=mesh)["eagle3"]


def _same_as_target(embed: np.ndarray, target_embed: jax.Array) -> bool:
    """Whether the draft's embedding equals the target's (then it is stored once)."""
    if tuple(embed.shape) != tuple(target_embed.shape):
        return False
    equal = jax.jit(lambda a, b: jnp.array_equal(a, b))(target_embed, jnp.asarray(embed, target_embed.dtype))
    return bool(equal)
