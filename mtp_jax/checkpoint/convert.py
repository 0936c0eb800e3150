"""``mtp-jax convert``: a hub checkpoint -> an orbax checkpoint in our parameter layout.

Layout of a converted directory::

    config.json, generation_config.json, tokenizer files   (copied from the source)
    mtp_jax_manifest.json                                   (format, options, groups, FP8 leaves)
    params/<group>/                                         (one orbax checkpoint per group)

A group is what the model's key map (:mod:`mtp_jax.checkpoint.formats`) yields: the embedding, one
decoder layer, the final norm, the head, one MTP layer. Weights are already transposed, split per
head, dequantised or kept FP8, so loading is a plain restore.

Safety: everything is written under ``<dst>.partial`` and renamed to ``<dst>`` at the very end,
so an interrupted conversion never leaves something that looks finished. ``progress.json`` inside
the partial directory records finished groups; re-running the same command resumes after the
last finished group (a changed source or different options start over).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.formats import checkpoint_format
from mtp_jax.checkpoint.gguf import GGUFCheckpoint, is_gguf
from mtp_jax.checkpoint.loader import FLOAT32_LEAVES, host_dtype
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import ModelConfig, load_config, parse_config
from mtp_jax.errors import CheckpointError, CheckpointNotFoundError
from mtp_jax.fp8 import Fp8Weight, materialize
from mtp_jax.progress import Progress

log = logging.getLogger(__name__)

FORMAT = "mtp-jax-orbax"
FORMAT_VERSION = 1
MANIFEST = "mtp_jax_manifest.json"
PROGRESS = "progress.json"
CONVERT_WEIGHTS = ("auto", "bf16", "fp32", "fp8")
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    dst: str
    groups: int
    groups_resumed: int
    tensors: int
    bytes_read: int
    seconds: float


def is_converted(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def _group_dir(name: str, index: int | None) -> str:
    return name if index is None else f"{name}_{index:03d}"


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _fingerprint(src: str, reader: CheckpointReader, options: dict) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    if os.path.isfile(src):  # a GGUF file
        root, names = os.path.dirname(src), [os.path.basename(src)]
    else:
        root = src
        names = sorted(
            {"config.json"} | {f for f in os.listdir(src) if f.endswith((".safetensors", ".json"))}
        )
    for name in names:
        st = os.stat(os.path.join(root, name))
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _to_storable(tree: Any, prefix: str, fp8_meta: dict[str, dict]) -> Any:
    """Fp8Weight leaves -> {"fp8", "scale_inv"} dicts (their static fields go to the manifest)."""
    if isinstance(tree, Fp8Weight):
        fp8_meta[prefix] = {"shape": list(tree.shape), "block": list(tree.block)}
        return {"fp8": tree.w, "scale_inv": tree.scale_inv}
    if isinstance(tree, dict):
        return {k: _to_storable(v, f"{prefix}/{k}", fp8_meta) for k, v in tree.items()}
    return tree


def _from_storable(tree: Any, prefix: str, fp8_meta: dict[str, dict]) -> Any:
    if prefix in fp8_meta:
        meta = fp8_meta[prefix]
        return Fp8Weight(
            w=tree["fp8"], scale_inv=tree["scale_inv"], shape=tuple(meta["shape"]), block=tuple(meta["block"])
        )
    if isinstance(tree, dict):
        return {k: _from_storable(v, f"{prefix}/{k}", fp8_meta) for k, v in tree.items()}
    return tree


def _open_source(src: str, dst: str) -> tuple[GGUFCheckpoint | None, ModelConfig, Any]:
    """(the GGUF file or None, the model config, a tensor reader) for a conversion's source; a GGUF
    file's quantised tensors are dequantised to float32 as they are read. Refuses a missing or
    already converted source and an existing destination."""
    gguf = os.path.isfile(src) and is_gguf(src)
    if not gguf and not os.path.isdir(src):
        raise CheckpointNotFoundError(f"source checkpoint directory or GGUF file not found: {src}")
    if is_converted(src):
        raise CheckpointError(f"{src} is already a converted mtp-jax checkpoint")
    if os.path.exists(dst):
        raise FileExistsError(f"destination {dst} already exists; remove it or choose another path")
    if gguf:
        source = GGUFCheckpoint(src)
        return source, parse_config(source.hf_config()), source.tensors()
    return None, load_config(os.path.join(src, "config.json")), CheckpointReader(src)


def _resume_state(work: str, fingerprint: str) -> dict:
    """The progress of an interrupted conversion in ``work`` when it was started from the same source
    and options (``fingerprint``), else a fresh state (a stale ``work`` is removed)."""
    state = {"fingerprint": fingerprint, "done": {}, "fp8": {}}
    if not os.path.isdir(work):
        return state
    try:
        with open(os.path.join(work, PROGRESS), encoding="utf-8") as f:
            previous = json.load(f)
    except (OSError, json.JSONDecodeError):
        previous = {}
    if previous.get("fingerprint") == fingerprint:
        log.info("resuming %s: %d groups already converted", work, len(previous["done"]))
        return previous
    log.info("discarding %s: it was started from a different source or options", work)
    shutil.rmtree(work)
    return state


def _nbytes(reader: Any, keys: Any) -> int:
    return sum(int(np.prod(reader.shape(k))) * reader.dtype(k).itemsize for k in keys)


def _save_group(checkpointer: Any, work: str, state: dict, tree: Any, gdir: str, record: dict) -> None:
    """One converted group saved under ``work``/params (a half-written one from an interrupted run
    replaced) and recorded as done in the progress file."""
    target = os.path.join(work, "params", gdir)
    if os.path.exists(target):
        shutil.rmtree(target)
    checkpointer.save(target, _to_storable(tree, gdir, state["fp8"]))
    checkpointer.wait_until_finished()
    state["done"][gdir] = record
    _write_json(os.path.join(work, PROGRESS), state)


def _copy_side_files(source: GGUFCheckpoint | None, src: str, work: str) -> None:
    """The config, tokenizer and generation files beside the weights: written from a GGUF file's
    metadata, or copied from a hub directory."""
    if source is not None:
        source.write_hub_files(work)
        return
    for fname in COPIED_FILES:
        if os.path.isfile(os.path.join(src, fname)):
            shutil.copyfile(os.path.join(src, fname), os.path.join(work, fname))


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    weights: str = "auto",
    mtp: bool = True,
    strict: bool = False,
    progress: bool = True,
    on_group: Callable[[str], None] | None = None,
) -> ConvertReport:
    """Convert the hub checkpoint (directory) or GGUF file ``src`` into an orbax checkpoint at ``dst``.

    weights: "auto" (default) keeps every tensor's stored precision: FP8 weights stay FP8 with their
    block scales, BF16 stays BF16, FP32 stays FP32, so that loading the converted checkpoint gives
    exactly what loading the source gives, in any dtype. "bf16" or "fp32" store everything dense in
    that dtype (FP8 dequantised); "fp8" keeps FP8 weights and stores the rest in bf16. ``on_group``
    is called with each finished group's name (tests use it to interrupt a conversion).
    """
    import orbax.checkpoint as ocp

    src, dst = os.fspath(src), os.fspath(dst)
    if weights not in CONVERT_WEIGHTS:
        raise ValueError(f"weights must be one of {CONVERT_WEIGHTS}, got {weights!r}")
    source, cfg, reader = _open_source(src, dst)
    fmt = checkpoint_format(cfg)
    if weights == "fp8" and cfg.quantization_config is None:
        raise CheckpointError(
            f"--weights fp8 needs an FP8 source checkpoint; {src}/config.json has no quantization_config"
        )
    dtype = {"auto": None, "fp32": "float32"}.get(weights, "bfloat16")
    keep_fp8 = weights == "fp8" or (weights == "auto" and cfg.quantization_config is not None)
    mode = "fp8" if keep_fp8 else "dense"
    options = {"weights": weights, "mtp": mtp, "format_version": FORMAT_VERSION}

    work = f"{dst}.partial"
    fingerprint = _fingerprint(src, reader, options)
    state = _resume_state(work, fingerprint)
    os.makedirs(os.path.join(work, "params"), exist_ok=True)

    done: dict[str, dict] = state["done"]
    skip = {(g["name"], g["index"]): g["keys"] for g in done.values()}
    total_bytes = _nbytes(reader, reader.keys())
    label = f"convert {os.path.basename(src.rstrip('/'))}"
    bar = Progress(label, len(reader.keys()), total_bytes) if progress else None
    checkpointer = ocp.StandardCheckpointer()
    order: list[str] = []
    resumed = len(done)
    t0 = time.perf_counter()
    bytes_read = 0
    for (name, index, tree), keys in fmt.param_groups(
        reader, cfg, dtype, weights=mode, mtp=mtp, strict=strict, skip=skip
    ):
        gdir = _group_dir(name, index)
        order.append(gdir)
        nbytes = _nbytes(reader, keys)
        if tree is not None:
            _save_group(checkpointer, work, state, tree, gdir, {"name": name, "index": index, "keys": keys})
            bytes_read += nbytes
            if on_group is not None:
                on_group(gdir)
        if bar is not None:
            bar.update(len(keys), nbytes, gdir)
    checkpointer.close()

    _copy_side_files(source, src, work)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": weights, "dtype": dtype}
    manifest.update(fp8_kept=keep_fp8, mtp=mtp, fp8=state["fp8"], source=os.path.abspath(src))
    manifest["groups"] = [{"dir": g, "name": done[g]["name"], "index": done[g]["index"]} for g in order]
    manifest.update(source_tensors=len(reader.keys()), source_bytes=total_bytes)
    _write_json(os.path.join(work, MANIFEST), manifest)
    os.remove(os.path.join(work, PROGRESS))
    os.replace(work, dst)
    return ConvertReport(
        dst=dst,
        groups=len(order),
        groups_resumed=resumed,
        tensors=len(reader.keys()),
        bytes_read=bytes_read,
        seconds=time.perf_counter() - t0,
    )


def _cast(tree: Any, name: str, dtype: Any, keep_fp8: bool) -> Any:
    """Stored leaves -> what the model wants: FP8 kept or dequantised, the rest in ``dtype`` except
    the float32 router leaves. Works on host (numpy) and device (jax) arrays alike."""
    if isinstance(tree, Fp8Weight):
        if keep_fp8:
            return tree
        if isinstance(tree.w, np.ndarray):
            return tree.dequantize_host(dtype)
        return materialize(tree, dtype)
    if isinstance(tree, dict):
        return {k: _cast(v, k, dtype, keep_fp8) for k, v in tree.items()}
    want = np.float32 if name in FLOAT32_LEAVES else dtype
    return tree.astype(want) if tree.dtype != want else tree


def load_converted(
    path: str,
    cfg: ModelConfig,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Restore a converted checkpoint into device parameters, one group at a time. With a mesh,
    each group is restored by orbax straight into its sharding (each device reads its own slice)."""
    import orbax.checkpoint as ocp

    from mtp_jax.sharding import group_shardings

    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}/{MANIFEST}: unsupported format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')!r} (this mtp-jax reads {FORMAT} version {FORMAT_VERSION})"
        )
    if weights == "fp8" and not manifest.get("fp8_kept", manifest["weights"] == "fp8"):
        raise CheckpointError(
            f"weights='fp8' needs a checkpoint converted with its FP8 weights kept (--weights auto or fp8); "
            f"{path} has {manifest['weights']!r} weights"
        )
    key_map = checkpoint_format(cfg)
    draft_groups = key_map.DRAFT_GROUPS
    own = [g for g in draft_groups if key_map.group_sizes(cfg, True).get(g)]
    if mtp and own and not manifest["mtp"]:
        log.warning("%s was converted without its own draft's weights (%s)", path, ", ".join(own))
    host = host_dtype(dtype)
    checkpointer = ocp.StandardCheckpointer()

    def restore(gdir: str, name: str) -> Any:
        if mesh is None:
            return checkpointer.restore(gdir)
        meta = checkpointer.metadata(gdir).item_metadata.tree
        shardings = group_shardings(mesh, name, meta)
        target = jax.tree.map(
            lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s), meta, shardings
        )
        return checkpointer.restore(gdir, target)

    def groups():
        for g in manifest["groups"]:
            if g["name"] in draft_groups and not mtp:
                continue
            gdir = os.path.join(path, "params", g["dir"])
            if not os.path.isdir(gdir):
                raise CheckpointError(f"converted checkpoint {path} is missing group {g['dir']}")
            tree = _from_storable(restore(gdir, g["name"]), g["dir"], manifest["fp8"])
            yield (
                g["name"],
                g["index"],
                _cast(tree, g["name"], host if mesh is None else dtype, weights == "fp8"),
            )

    try:
        return checkpoint_format(cfg).assemble(groups(), cfg, dtype, mtp=mtp and manifest["mtp"], mesh=mesh)
    finally:
        checkpointer.close()
