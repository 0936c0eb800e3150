"""DSpark draft checkpoints as DeepSpec releases them (``architectures: [Qwen3DSparkModel]``) ->
``params["dspark"]`` (:mod:`mtp_jax.drafts.dspark.draft`), and back.

The layout (docs/formats.md, "DSpark drafts"): no ``model.`` prefix; ``embed_tokens`` and
``lm_head`` [V, d], frozen copies of the target's (read only to check that they are: the step uses
the target's own); ``fc`` [d, m·d], ``hidden_norm``, ``norm``, ``layers.{i}.*`` (Qwen3 decoder
layers with ``q_norm`` / ``k_norm``); ``markov_head.markov_w1`` [V, r] and ``markov_w2`` [V, r]
(the paper's W2 stored transposed); the RNN head's ``markov_head.joint_proj`` [3r, 2r + d] + bias
or the gated head's ``markov_head.gate_proj`` [r, d + r] + bias; ``confidence_head.proj`` [1, d (+ r)]
+ bias [1].
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.hub_layout import as_numpy, linear_to_hub, vocab_map_tensors
from mtp_jax.checkpoint.loader import HubTensors, assemble_groups, read_vocab_map, report_unused
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.drafts.dspark.config import DSparkConfig, dspark_capture, is_dspark_config, parse_dspark_config
from mtp_jax.errors import ConfigError
from mtp_jax.targets.base import head_columns
from mtp_jax.targets.llama.checkpoint import layer_from_leaves, llama_layer_tensors
from mtp_jax.targets.llama.model import layer_leaves

log = logging.getLogger(__name__)

FROZEN = ("embed_tokens.weight", "lm_head.weight")
"""The target's embedding and head, copied into every DeepSpec checkpoint."""
_SAMPLE_ROWS = 64


def is_dspark(raw: dict, reader: CheckpointReader) -> bool:
    """Whether a draft directory holds a DSpark draft (its architecture)."""
    return is_dspark_config(raw)


def _check_frozen(reader: CheckpointReader, target_params: dict | None, vocab: int, d: int) -> list[str]:
    """The frozen embedding and head, when stored, against the target's at a spread of rows (a
    draft trained against another target is refused). Returns the keys read."""
    read = []
    for key in FROZEN:
        if key not in reader:
            continue
        if reader.shape(key) != (vocab, d):
            raise ConfigError(
                f"{reader.directory}: '{key}' is {list(reader.shape(key))}; the target's is {[vocab, d]}"
            )
        read.append(key)
        if target_params is None:
            continue
        rows = np.unique(np.linspace(0, vocab - 1, _SAMPLE_ROWS).astype(np.int64))
        stored = reader.get(key)[rows].astype(np.float32)
        if key == "embed_tokens.weight":
            mine = np.asarray(jax.device_get(target_params["embed"][rows]), np.float32)
        else:
            mine = np.asarray(head_columns(target_params, rows), np.float32).T
        scale = float(np.abs(mine).max()) or 1.0
        if not np.allclose(stored, mine, rtol=1e-2, atol=1e-2 * scale):
            raise ConfigError(
                f"{reader.directory}: the draft's frozen '{key}' is not this target's (a DSpark draft copies "
                "the target's embedding and head; it was trained for another model)"
            )
    return read


def _heads(t: HubTensors, cfg: DSparkConfig, vocab: int, draft_vocab: int) -> dict:
    """The Markov and confidence heads; W1 is looked up by the previous token's target id, W2 covers
    the draft vocabulary (``draft_vocab``: the target's whole one without ``d2t``)."""
    d, r = cfg.hidden_size, cfg.markov_rank
    tree: dict[str, Any] = {}
    if r > 0:
        m = {
            "w1": t.get("markov_head.markov_w1.weight", (vocab, r)),
            "w2": np.ascontiguousarray(t.get("markov_head.markov_w2.weight", (draft_vocab, r)).T),
        }
        if cfg.markov_head_type == "rnn":
            m["joint"] = t.linear("markov_head.joint_proj.weight", 3 * r, 2 * r + d)
            m["joint_bias"] = t.get("markov_head.joint_proj.bias", (3 * r,))
        elif cfg.markov_head_type == "gated":
            m["gate"] = t.linear("markov_head.gate_proj.weight", r, d + r)
            m["gate_bias"] = t.get("markov_head.gate_proj.bias", (r,))
        tree["markov"] = m
    if cfg.confidence_head:
        width = cfg.confidence_width
        tree["confidence"] = {
            "w": t.get("confidence_head.proj.weight", (1, width)).reshape(width),
            "b": t.get("confidence_head.proj.bias", (1,)).reshape(()),
        }
    return tree


def load_dspark(
    reader: CheckpointReader,
    raw: dict,
    target_cfg: Any,
    dtype: Any,
    *,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    verbose: bool = True,
    target_params: dict | None = None,
) -> tuple[DSparkConfig, dict]:
    """Read a DSpark draft for the target ``target_cfg``. Returns (config with its captured layers
    resolved, ``params["dspark"]``)."""
    path = reader.directory
    cfg = parse_dspark_config(raw)
    d, vocab = cfg.hidden_size, target_cfg.vocab_size
    if d != target_cfg.hidden_size:
        raise ConfigError(
            f"{path}: the DSpark draft's hidden_size is {d}, the target's {target_cfg.hidden_size} (the "
            "draft reads the target's embedding and head, so the widths must match)"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != vocab:
        raise ConfigError(f"{path}: the DSpark draft's vocab_size is {cfg.vocab_size}, the target's {vocab}")
    if cfg.mask_token_id >= vocab:
        raise ConfigError(f"{path}: mask_token_id {cfg.mask_token_id} is outside the target's {vocab} tokens")
    cfg = dataclasses.replace(cfg, capture=dspark_capture(cfg, target_cfg.num_hidden_layers))
    b = cfg.backbone
    t = HubTensors(reader, b, dtype)
    leaves = layer_leaves(
        d, b.num_attention_heads, b.num_key_value_heads, b.head_dim, b.intermediate_size, qk_norm=True
    )
    layers = [layer_from_leaves(t, f"layers.{i}.", leaves) for i in range(b.num_hidden_layers)]
    draft_vocab = cfg.draft_vocab_size or vocab
    if draft_vocab > vocab:
        raise ConfigError(f"{path}: draft_vocab_size {draft_vocab} exceeds the target's {vocab} tokens")
    tree = {
        "fc": t.linear("fc.weight", d, len(cfg.capture) * d),
        "hidden_norm": t.get("hidden_norm.weight", (d,)),
        "norm": t.get("norm.weight", (d,)),
        "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers),
        **_heads(t, cfg, vocab, draft_vocab),
    }
    used = set(t.used) | set(_check_frozen(reader, target_params, vocab, d))
    d2t = "d2t" if "d2t" in reader else None
    ids = read_vocab_map(reader, d2t, "t2d" if "t2d" in reader else None, draft_vocab, vocab, used)
    if ids is not None:  # the block's head: the target's columns for those ids, read at load
        if target_params is None:
            raise ConfigError(f"{path}: a DSpark draft vocabulary needs the target's head (target_params)")
        tree["draft_to_target"] = ids
        cols = head_columns(target_params, ids)
        tree["lm_head"] = cols if t.dtype is None else cols.astype(t.dtype)
    report_unused(reader, used, strict=strict, logger=log)
    head = {0: "no sequential head"}.get(
        cfg.markov_rank, f"a {cfg.markov_head_type} head of rank {cfg.markov_rank}"
    )
    conf = "a confidence head" + (
        "" if cfg.confidence_temperatures is None and cfg.confidence_shifts is None else " (calibrated)"
    )
    if ids is not None:
        head += f", a draft vocabulary of {draft_vocab} of the target's {vocab} tokens"
    note = (
        f"DSpark draft {path}: {b.num_hidden_layers} layers, block size {b.block_size}, {head}, "
        f"{conf if cfg.confidence_head else 'no confidence head'}, mask id {cfg.mask_token_id}; reads target "
        f"outputs of layers {', '.join(map(str, cfg.capture))} (-1: the embedding)"
    )
    log.info(note)
    if verbose:
        print(note, file=sys.stderr)
    return cfg, assemble_groups([("dspark", None, tree)], {}, mesh=mesh)["dspark"]


def dspark_config_dict(cfg: DSparkConfig, target_raw: dict) -> dict:
    """config.json as DeepSpec writes it: the target's text config (``target_raw``) with the
    draft's architecture, layers and DSpark fields (mtp-jax's calibration when fitted)."""
    b = cfg.backbone
    raw = {
        **{k: v for k, v in target_raw.items() if k not in ("quantization_config", "auto_map")},
        "architectures": [cfg.architecture],
        "hidden_size": b.hidden_size,
        "intermediate_size": b.intermediate_size,
        "num_hidden_layers": b.num_hidden_layers,
        "num_attention_heads": b.num_attention_heads,
        "num_key_value_heads": b.num_key_value_heads,
        "head_dim": b.head_dim,
        "rms_norm_eps": b.rms_norm_eps,
        "rope_theta": b.rope_theta,
        "max_position_embeddings": b.max_position_embeddings,
        "attention_bias": False,
        "block_size": b.block_size,
        "mask_token_id": b.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": cfg.num_target_layers,
        "markov_rank": cfg.markov_rank,
        "enable_confidence_head": cfg.confidence_head,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * b.num_hidden_layers,
    }
    raw.pop("rope_scaling", None)
    raw.pop("rope_parameters", None)
    if cfg.markov_rank > 0:
        raw["markov_head_type"] = cfg.markov_head_type
    if cfg.confidence_head:
        raw["confidence_head_with_markov"] = cfg.confidence_with_markov
    if cfg.confidence_temperatures is not None:
        raw["confidence_temperatures"] = list(cfg.confidence_temperatures)
    if cfg.confidence_shifts is not None:
        raw["confidence_shifts"] = list(cfg.confidence_shifts)
    if cfg.draft_vocab_size is not None:
        raw["draft_vocab_size"] = cfg.draft_vocab_size
    else:
        raw.pop("draft_vocab_size", None)
    return raw


def dspark_hub_tensors_from_params(
    tree: dict, cfg: DSparkConfig, target_params: dict, dtype: Any = np.float32
) -> dict[str, np.ndarray]:
    """A DSpark draft (``params["dspark"]``, as :func:`load_dspark` builds it) in DeepSpec's layout,
    with the frozen copies of the target's embedding and head (``target_params``)."""
    dtype = np.dtype(dtype)
    tree = jax.device_get(tree)
    embed = as_numpy(jax.device_get(target_params["embed"]), dtype)
    vocab = embed.shape[0]
    head = np.ascontiguousarray(as_numpy(head_columns(target_params, np.arange(vocab)), dtype).T)
    t = {
        "embed_tokens.weight": embed,
        "lm_head.weight": head,
        "fc.weight": linear_to_hub(tree["fc"], dtype),
        "hidden_norm.weight": as_numpy(tree["hidden_norm"], dtype),
        "norm.weight": as_numpy(tree["norm"], dtype),
    }
    for i in range(cfg.num_hidden_layers):
        t.update(
            llama_layer_tensors(jax.tree.map(lambda x, i=i: x[i], tree["layers"]), f"layers.{i}.", dtype)
        )
    if "markov" in tree:
        m = tree["markov"]
        t["markov_head.markov_w1.weight"] = as_numpy(m["w1"], dtype)
        t["markov_head.markov_w2.weight"] = np.ascontiguousarray(as_numpy(m["w2"], dtype).T)
        for name, hub in (("joint", "joint_proj"), ("gate", "gate_proj")):
            if name in m:
                t[f"markov_head.{hub}.weight"] = linear_to_hub(m[name], dtype)
                t[f"markov_head.{hub}.bias"] = as_numpy(m[f"{name}_bias"], dtype)
    if "confidence" in tree:
        c = tree["confidence"]
        t["confidence_head.proj.weight"] = as_numpy(c["w"], dtype).reshape(1, -1)
        t["confidence_head.proj.bias"] = as_numpy(c["b"], dtype).reshape(1)
    if "draft_to_target" in tree:  # the head is the target's columns: only the map is stored
        t.update(vocab_map_tensors(np.asarray(tree["draft_to_target"]), vocab))
    return t
