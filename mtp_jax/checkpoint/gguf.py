"""GGUF checkpoints (llama.cpp's single-file format) read as if they were a hub checkpoint.

A GGUF file holds its metadata (architecture, sizes, rope and norm settings, the tokenizer and its
chat template) and its tensors, many of them block-quantised. :class:`GGUFCheckpoint` opens one
(memory-mapped, through the ``gguf`` package: ``pip install 'mtp-jax[gguf]'``) and presents

* ``hf_config()``: the config.json a Hugging Face checkpoint of the same model would carry;
* ``tensors()``: a reader with the hub tensor names and layouts (``model.layers.{i}.self_attn.q_proj
  .weight`` [out, in], ...), each tensor dequantised to float32 only when it is read, so loading
  streams tensor by tensor through the same key maps as safetensors checkpoints;
* ``tokenizer_json()`` / ``tokenizer_config()``: the GGUF's own BPE tokenizer as a ``tokenizers``
  tokenizer.json and its chat template, BOS/EOS tokens and ``add_bos_token`` rule.

Tensor types read: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (any other is
refused by name). What a GGUF architecture means (its config from the metadata, llama.cpp's tensor
names, tensors llama.cpp reorders) is the model folder's: a :class:`GGUFLayout` its target
registers (``register_target(..., gguf=)``; the Llama family's is
:mod:`mtp_jax.targets.llama.gguf`). This module reads the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from mtp_jax.errors import CheckpointError, CheckpointNotFoundError, ConfigError

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
MAGIC = b"GGUF"
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class GGUFLayout:
    """What GGUF files of some architectures hold, as the model folder that reads them declares it.

    ``hf_config(ckpt) -> dict``: the config.json of the same model from the file's metadata
    (``ckpt.meta(key)`` reads ``{architecture}.{key}``); ``global_names`` / ``layer_names``:
    llama.cpp tensor names -> hub names (layer ones under ``blk.{i}.`` -> ``model.layers.{i}.``);
    ``fixup(ckpt, hub_name, array) -> array``: a tensor put back in hub layout (llama.cpp reorders
    some); ``consumed``: tensors read into the config, not weights."""

    architectures: tuple[str, ...]
    hf_config: Callable[[GGUFCheckpoint], dict]
    global_names: Mapping[str, str]
    layer_names: Mapping[str, str]
    fixup: Callable[[GGUFCheckpoint, str, np.ndarray], np.ndarray] | None = None
    consumed: tuple[str, ...] = ()


_LAYOUTS: dict[str, GGUFLayout] = {}


def register_gguf_layout(layout: GGUFLayout) -> None:
    """Read GGUF files of ``layout.architectures`` with ``layout`` (a target's registration does
    this: ``register_target(..., gguf=)``)."""
    for arch in layout.architectures:
        _LAYOUTS[arch] = layout


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF architectures some registered target reads."""
    return tuple(sorted(_LAYOUTS))


def _gguf_module():
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install 'mtp-jax[gguf]'") from e
    return gguf


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


class GGUFCheckpoint:
    """One GGUF file: its metadata, its tensors (read lazily) and what it implies (config, tokenizer)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointNotFoundError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            head = f.read(4)
        if head != MAGIC:
            raise CheckpointError(f"{self.path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
        _gguf_module()  # the gguf package dequantises; a clear error when it is missing
        from mtp_jax.checkpoint.gguf_file import read_gguf

        try:
            self.metadata, self._tensors = read_gguf(self.path)
        except Exception as e:  # GGUFFormatError, or whatever decoding a garbled header raises
            raise CheckpointError(
                f"{self.path}: malformed or truncated GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in _LAYOUTS:
            raise ConfigError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(gguf_architectures())}"
            )
        self.layout = _LAYOUTS[self.architecture]

    # --- metadata -----------------------------------------------------------------------------
    def meta(self, key: str, default: Any = ...) -> Any:
        """Metadata field ``{architecture}.{key}`` (``general.*`` and ``tokenizer.*`` as named);
        without ``default``, a missing field is a :class:`ConfigError` naming it."""
        full = f"{self.architecture}.{key}" if not key.startswith(("general.", "tokenizer.")) else key
        if full not in self.metadata:
            if default is ...:
                raise ConfigError(f"{self.path}: GGUF metadata is missing '{full}'")
            return default
        return self.metadata[full]

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Numpy (row-major) shape: GGUF lists dimensions innermost first."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def hf_config(self) -> dict:
        """The Hugging Face config.json equivalent of this GGUF's metadata (its layout's)."""
        return self.layout.hf_config(self)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    # --- tensors ------------------------------------------------------------------------------
    def array(self, name: str) -> np.ndarray:
        """A tensor as stored (F16/BF16 kept, quantised types dequantised to float32), numpy shape."""
        t = self._tensors[name]
        kind = t.tensor_type.name
        shape = self.tensor_shape(name)
        if kind not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' has GGUF type {kind}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        data = np.asarray(t.data())
        if kind == "F32":
            out = data.view(np.float32)
        elif kind == "F16":
            out = data.view(np.float16)
        elif kind == "BF16":
            out = data.view(np.uint16).view(ml_dtypes.bfloat16)
        else:
            from gguf.quants import dequantize

            out = dequantize(data, t.tensor_type)
        if out.size != math.prod(shape):
            raise CheckpointError(
                f"{self.path}: tensor '{name}' holds {out.size} values, its shape {list(shape)} implies "
                f"{math.prod(shape)}"
            )
        return np.ascontiguousarray(out.reshape(shape))

    def tensors(self, progress: bool = False) -> GGUFTensors:
        """The tensors under hub names; ``progress`` draws a progress line on stderr as they are read."""
        return GGUFTensors(self, progress)

    def stored_bytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    # --- tokenizer ----------------------------------------------------------------------------
    def tokenizer_json(self) -> str:
        """The GGUF's tokenizer as a ``tokenizers`` tokenizer.json
        (:func:`mtp_jax.checkpoint.gguf_tokenizer.tokenizer_json`)."""
        from mtp_jax.checkpoint.gguf_tokenizer import tokenizer_json

        return tokenizer_json(self)

    def tokenizer_config(self) -> dict:
        """tokenizer_config.json's equivalent: chat template, BOS/EOS tokens, ``add_bos_token``."""
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        out: dict[str, Any] = {
            "add_bos_token": bool(self.metadata.get("tokenizer.ggml.add_bos_token", False))
        }
        for key, name in (
            ("tokenizer.ggml.bos_token_id", "bos_token"),
            ("tokenizer.ggml.eos_token_id", "eos_token"),
        ):
            i = self.metadata.get(key)
            if i is not None and 0 <= int(i) < len(tokens):
                out[name] = tokens[int(i)]
        template = self.metadata.get("tokenizer.chat_template")
        if isinstance(template, str):
            out["chat_template"] = template
        return out

    def generation_config(self) -> dict:
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        return {} if eos is None else {"eos_token_id": int(eos)}

    def write_hub_files(self, directory: str) -> None:
        """config.json, tokenizer.json, tokenizer_config.json and generation_config.json in ``directory``."""
        files = {
            "config.json": json.dumps(self.hf_config(), indent=2),
            "tokenizer.json": self.tokenizer_json(),
            "tokenizer_config.json": json.dumps(self.tokenizer_config(), indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps(self.generation_config(), indent=2),
        }
        for name, text in files.items():
            tmp = os.path.join(directory, f".{name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, os.path.join(directory, name))


class GGUFTensors:
    """A GGUF's tensors under hub names, in hub layouts: the reader interface of
    :class:`mtp_jax.checkpoint.safetensors_io.CheckpointReader` (``keys``, ``shape``, ``dtype``,
    ``get``), each put back in hub layout by its :class:`GGUFLayout`."""

    def __init__(self, ckpt: GGUFCheckpoint, progress: bool = False) -> None:
        self.ckpt = ckpt
        self.directory = ckpt.path
        self._bar = None
        if progress:
            from mtp_jax.progress import Progress

            names = [n for n in ckpt.tensor_names() if n not in ckpt.layout.consumed]
            total = sum(ckpt.stored_bytes(n) for n in names)
            self._bar = Progress(f"load {os.path.basename(ckpt.path)}", len(names), total)
        self._names: dict[str, str] = {}  # hub name -> GGUF name
        for name in ckpt.tensor_names():
            if name in ckpt.layout.consumed:  # read into the config
                continue
            self._names[_hub_name(ckpt.layout, name)] = name

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def _gguf(self, key: str) -> str:
        if key not in self._names:
            raise CheckpointError(f"GGUF file {self.directory} has no tensor for '{key}'")
        return self._names[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.ckpt.tensor_shape(self._gguf(key))

    def dtype(self, key: str) -> np.dtype:
        kind = self.ckpt.tensor_type(self._gguf(key))
        if kind == "F16":
            return np.dtype(np.float16)
        if kind == "BF16":
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(np.float32)

    def get(self, key: str) -> np.ndarray:
        x = self.ckpt.array(self._gguf(key))
        if self._bar is not None:
            self._bar.update(1, self.ckpt.stored_bytes(self._gguf(key)), key)
        fixup = self.ckpt.layout.fixup
        return x if fixup is None else fixup(self.ckpt, key, x)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for key in self._names:
            yield key, self.get(key)


def _hub_name(layout: GGUFLayout, name: str) -> str:
    if name in layout.global_names:
        return layout.global_names[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in layout.layer_names:
        return f"model.layers.{m.group(1)}.{layout.layer_names[m.group(2)]}"
    return name  # kept under its own name: reported as unused (refused with strict)
