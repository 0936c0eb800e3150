"""A strict safetensors reader (tensor by tensor, positioned reads) and an atomic writer.

We parse the format ourselves instead of going through ``safetensors.numpy`` because numpy has no
bfloat16/float8 of its own (``ml_dtypes``, which JAX ships, does), and because a truncated or
corrupt file must fail with a message that names the file and the tensor. Only safetensors are
read; there is no pickle path anywhere.

Format: 8-byte little-endian header length N, N bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data
block; offsets are relative to the start of the data block.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from mtp_jax.errors import CheckpointError, CheckpointNotFoundError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


def _is_index(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_MAX_HEADER = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


class SafetensorsFile:
    """One safetensors file, memory-mapped; :meth:`get` returns a read-only view, no copy."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointNotFoundError(f"safetensors file not found: {self.path}")
        size = os.path.getsize(self.path)
        if size < 8:
            raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{self.path}: corrupt or truncated safetensors file "
                    f"(header of {n} bytes, file of {size})"
                )
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_size = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, data_size)
        self._check_coverage(data_size)
        self._file = None

    def _check_entry(
        self, name: str, entry: object, data_size: int
    ) -> tuple[np.dtype, tuple[int, ...], int, int]:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{self.path}: tensor '{name}' has a malformed header entry")
        kind, dims, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(kind, str) or kind not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {kind!r}")
        dtype = DTYPES[kind]
        if not isinstance(dims, list) or not all(_is_index(d) for d in dims):
            raise CheckpointError(f"{self.path}: tensor '{name}' has a malformed shape {dims!r}")
        shape = tuple(dims)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(o) for o in offsets):
            raise CheckpointError(f"{self.path}: tensor '{name}' has malformed data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' claims {end - begin} bytes but shape {list(shape)} of "
                f"{entry['dtype']} needs {nbytes}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{self.path}: truncated file: tensor '{name}' ends at byte {end} "
                f"of a {data_size}-byte data block"
            )
        return dtype, shape, begin, end

    def _check_coverage(self, data_size: int) -> None:
        """The format requires the data block to be tiled by the tensors: no overlaps, no holes."""
        pos = 0
        for name, (_, _, begin, end) in sorted(self._entries.items(), key=lambda kv: kv[1][2:]):
            if begin != pos:
                what = (
                    "overlaps the previous tensor" if begin < pos else f"leaves a gap of {begin - pos} bytes"
                )
                raise CheckpointError(f"{self.path}: corrupt data offsets: tensor '{name}' {what}")
            pos = end
        if pos != data_size:
            raise CheckpointError(
                f"{self.path}: corrupt file: tensors cover {pos} bytes of a {data_size}-byte data block"
            )

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[0]

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named '{name}'") from None

    def get(self, name: str) -> np.ndarray:
        """Read one tensor into a fresh array (one positioned read, no memory map: pages of tensors
        already consumed are not kept resident, so host memory tracks what the caller holds)."""
        dtype, shape, begin, end = self._entry(name)
        out = np.empty(shape, dtype)
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - kept open across reads, closed in close()
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < end - begin:  # a single read returns at most ~2 GiB on Linux
            got = os.preadv(self._file.fileno(), [view[done:]], self._data_start + begin + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: file ended while reading tensor '{name}'")
            done += got
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self.close()


class CheckpointReader:
    """All tensors of a hub-layout checkpoint directory: one file, several, or index-sharded."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise CheckpointNotFoundError(f"checkpoint directory not found: {self.directory}")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index_path = os.path.join(self.directory, INDEX_NAME)
        if os.path.isfile(index_path):
            self._read_index(index_path)
        else:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".safetensors"))
            if not names:
                raise CheckpointNotFoundError(f"no *.safetensors files in {self.directory}")
            for fname in names:
                for key in self._file(fname).keys():
                    if key in self._where:
                        raise CheckpointError(
                            f"tensor '{key}' appears in both {self._where[key]} and {fname} "
                            f"in {self.directory}"
                        )
                    self._where[key] = fname

    def _read_index(self, index_path: str) -> None:
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_path}: not valid JSON: {e}") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: missing the 'weight_map' object")
        root = os.path.realpath(self.directory)
        for key, fname in weight_map.items():
            if not isinstance(fname, str):
                raise CheckpointError(f"{index_path}: file name of tensor '{key}' is not a string")
            full = os.path.realpath(os.path.join(root, fname))
            if os.path.isabs(fname) or os.path.commonpath([root, full]) != root:
                raise CheckpointError(
                    f"{index_path}: tensor '{key}' points at '{fname}', outside the checkpoint directory"
                )
            self._where[key] = fname
        for fname in sorted(set(self._where.values())):
            f = self._file(fname)
            for key, where in self._where.items():
                if where == fname and key not in f:
                    raise CheckpointError(
                        f"{index_path}: tensor '{key}' is listed in {fname} but not stored there"
                    )

    def _file(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(os.path.join(self.directory, fname))
        return self._files[fname]

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def _locate(self, key: str) -> SafetensorsFile:
        if key not in self._where:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor '{key}'")
        return self._file(self._where[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return self._locate(key).shape(key)

    def dtype(self, key: str) -> np.dtype:
        return self._locate(key).dtype(key)

    def get(self, key: str) -> np.ndarray:
        return self._locate(key).get(key)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for key in self._where:
            yield key, self.get(key)


def save_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` to ``path`` atomically (temporary name, then rename). Returns bytes written."""
    path = os.fspath(path)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = []
    for name, value in tensors.items():
        arr = np.asarray(value, order="C")
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"cannot store tensor '{name}' of dtype {arr.dtype} in safetensors")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for arr in arrays:
                f.write(arr.tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return 8 + len(blob) + offset


def write_hub_checkpoint(
    directory: str | os.PathLike[str],
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    shards: int = 1,
    extra_files: Mapping[str, str] | None = None,
) -> None:
    """Write config.json, the tensors (split over ``shards`` files with an index when > 1) and any
    ``extra_files`` (name -> source path) into a new directory, atomically: everything goes to a
    temporary sibling first, which is renamed into place at the end."""
    directory = os.fspath(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"refusing to overwrite existing checkpoint directory {directory}")
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(config), f, indent=2)
            f.write("\n")
        keys = list(tensors)
        if shards == 1:
            save_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
        else:
            weight_map, total = {}, 0
            for s, part in enumerate(np.array_split(np.arange(len(keys)), shards)):
                name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
                chunk = {keys[j]: tensors[keys[j]] for j in part}
                save_safetensors(os.path.join(tmp, name), chunk, {"format": "pt"})
                weight_map.update({k: name for k in chunk})
                total += sum(x.nbytes for x in chunk.values())
            with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
