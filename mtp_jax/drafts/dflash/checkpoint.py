"""DFlash draft checkpoints (``architectures: [DFlashDraftModel]``) -> ``params["dflash"]``
(:mod:`mtp_jax.drafts.dflash.draft`).

The published layout (docs/formats.md, "DFlash drafts"): no ``model.`` prefix, ``fc.weight`` [H, C·H]
over C captured target layers, ``hidden_norm``, ``norm``, and ``layers.{i}.*`` Qwen3-style decoder
layers (``self_attn.q_norm`` / ``k_norm`` [head_dim] before rope). No embedding and no head: the
target's are used, so the draft's width must be the target's.

mtp-jax's extension: ``draft_vocab_size`` in config.json with a ``d2t`` tensor (EAGLE-3's offsets:
draft id j is target id j + d2t[j]) restricts the block's head to those target ids. The head itself
is still not stored: it is the target's head, its columns for those ids copied at load
(``params["dflash"]["lm_head"]`` [H, Vd] beside ``draft_to_target`` [Vd]).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.loader import HubTensors, assemble_groups, read_vocab_map, report_unused
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.drafts.dflash.config import DFlashConfig, dflash_capture, parse_dflash_config
from mtp_jax.errors import ConfigError
from mtp_jax.targets.base import head_columns
from mtp_jax.targets.llama.checkpoint import layer_from_leaves
from mtp_jax.targets.llama.model import layer_leaves

log = logging.getLogger(__name__)


def is_dflash(raw: dict, reader: CheckpointReader) -> bool:
    """Whether a draft directory holds a DFlash draft: its architecture or its ``dflash_config``."""
    archs = raw.get("architectures") or []
    return any("dflash" in str(a).lower() for a in archs) or "dflash_config" in raw


def load_dflash(
    reader: CheckpointReader,
    raw: dict,
    target_cfg: Any,
    dtype: Any,
    *,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    verbose: bool = True,
    target_params: dict | None = None,
) -> tuple[DFlashConfig, dict]:
    """Read a DFlash draft for the target ``target_cfg``. Returns (config with its captured layers
    resolved, ``params["dflash"]``: fc, hidden_norm, norm and the decoder layers stacked [n, ...];
    with a draft vocabulary also ``draft_to_target`` and ``lm_head``, the target's head columns
    for it, taken from ``target_params``)."""
    path = reader.directory
    cfg = parse_dflash_config(raw)
    h = cfg.hidden_size
    if h != target_cfg.hidden_size:
        raise ConfigError(
            f"{path}: the DFlash draft's hidden_size is {h}, the target's {target_cfg.hidden_size} (a DFlash "
            "draft uses the target's embedding and head, so the widths must match)"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(
            f"{path}: the DFlash draft's vocab_size is {cfg.vocab_size}, the target's {target_cfg.vocab_size}"
        )
    if cfg.mask_token_id >= target_cfg.vocab_size:
        raise ConfigError(
            f"{path}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
            f"({target_cfg.vocab_size} tokens)"
        )
    capture = dflash_capture(cfg, target_cfg.num_hidden_layers)
    cfg = dataclasses.replace(cfg, capture=capture)
    t = HubTensors(reader, cfg, dtype)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    width = len(capture) * h
    # Qwen3-style layers: the Llama family's with per-head q/k norms
    leaves = layer_leaves(h, nh, nkv, hd, cfg.intermediate_size, qk_norm=True)
    layers = [layer_from_leaves(t, f"layers.{i}.", leaves) for i in range(cfg.num_hidden_layers)]
    tree = {
        "fc": t.linear("fc.weight", h, width),
        "hidden_norm": t.get("hidden_norm.weight", (h,)),
        "norm": t.get("norm.weight", (h,)),
        "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers),
    }
    used = set(t.used)
    vocab = target_cfg.vocab_size
    draft_vocab = cfg.draft_vocab_size or vocab
    if draft_vocab > vocab:
        raise ConfigError(f"{path}: draft_vocab_size {draft_vocab} exceeds the target's {vocab} tokens")
    d2t = "d2t" if "d2t" in reader else None
    ids = read_vocab_map(reader, d2t, "t2d" if "t2d" in reader else None, draft_vocab, vocab, used)
    if ids is not None:
        if target_params is None:
            raise ConfigError(f"{path}: a DFlash draft vocabulary needs the target's head (target_params)")
        tree["draft_to_target"] = ids
        cols = head_columns(target_params, ids)
        tree["lm_head"] = cols if t.dtype is None else cols.astype(t.dtype)
    report_unused(reader, used, strict=strict, logger=log)
    how = "as written in its config" if cfg.target_layer_ids is not None else "by default"
    head = "" if ids is None else f", a head over {draft_vocab} of the target's {vocab} tokens"
    note = (
        f"DFlash draft {path}: {cfg.num_hidden_layers} layers, block size {cfg.block_size}{head}, mask id "
        f"{cfg.mask_token_id}; reads target outputs of layers {', '.join(map(str, capture))} (0-based, {how})"
    )
    log.info(note)
    if verbose:
        print(note, file=sys.stderr)
    return cfg, assemble_groups([("dflash", None, tree)], {}, mesh=mesh)["dflash"]
