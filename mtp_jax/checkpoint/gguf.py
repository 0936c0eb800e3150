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
refused by name). Architectures: ``llama`` (Llama 2/3 layouts and relatives such as SmolLM2),
``qwen2`` and ``qwen3`` (with their q/k/v biases and q/k norms). For ``llama`` llama.cpp's converter
reorders the query and key rows of each head for its interleaved rope; they are put back in the
rotate-half order of hub checkpoints here (Qwen GGUFs keep the hub order: llama.cpp runs them with
rotate-half rope).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from mtp_jax.errors import CheckpointError, CheckpointNotFoundError, ConfigError

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HUB_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MAGIC = b"GGUF"

# llama.cpp tensor names -> hub names (per-layer ones under blk.{i}.).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

# Pre-tokenizers (tokenizer.ggml.pre) we can express as a tokenizers pipeline. All are byte-level BPE.
_GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {**_GPT2_PRE, "use_regex": False},
        ],
    }


PRE_TOKENIZERS: dict[str, dict] = {
    "default": _GPT2_PRE,
    "gpt-2": _GPT2_PRE,
    # SmolLM / SmolLM2: every digit on its own, then GPT-2's byte-level split.
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2_PRE],
    },
    "llama-bpe": _split_then_bytes(_LLAMA3_REGEX),  # Llama 3
}

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens


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
        gguf = _gguf_module()
        try:
            reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises whatever numpy does on a short or garbled file
            raise CheckpointError(
                f"{self.path}: malformed or truncated GGUF file ({type(e).__name__}: {e})"
            ) from None
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = field.contents()
            except Exception as e:
                raise CheckpointError(f"{self.path}: metadata field '{name}' is malformed ({e})") from None
        size = os.path.getsize(self.path)
        self._tensors: dict[str, Any] = {}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.size * t.data.itemsize != int(t.n_bytes):
                raise CheckpointError(
                    f"{self.path}: tensor '{t.name}' ends at byte {end} but the file has {size}: truncated"
                )
            self._tensors[t.name] = t
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )

    # --- metadata -----------------------------------------------------------------------------
    def _meta(self, key: str, default: Any = ...) -> Any:
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
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def hf_config(self) -> dict:
        """The Hugging Face config.json equivalent of this GGUF's metadata."""
        heads = int(self._meta("attention.head_count"))
        hidden = int(self._meta("embedding_length"))
        head_dim = int(self._meta("attention.key_length", hidden // heads if heads else 0))
        rope_dims = int(self._meta("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ConfigError(
                f"{self.path}: rope over {rope_dims} of {head_dim} head dimensions (partial rope) is not "
                "supported"
            )
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab = int(self._meta("vocab_size", len(tokens) if tokens else 0))
        if "token_embd.weight" in self._tensors:
            vocab = self.tensor_shape("token_embd.weight")[0]
        kv = self._meta("attention.head_count_kv", heads)
        if isinstance(kv, list):
            raise ConfigError(f"{self.path}: per-layer key/value head counts are not supported")
        raw: dict[str, Any] = {
            "architectures": [_HUB_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(self._meta("feed_forward_length")),
            "num_hidden_layers": int(self._meta("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._meta("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu",
        }
        for key, out in (
            ("tokenizer.ggml.bos_token_id", "bos_token_id"),
            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ):
            if key in self.metadata:
                raw[out] = int(self.metadata[key])
        scaling = self._rope_scaling(head_dim, raw["rope_theta"])
        if scaling is not None:
            raw["rope_scaling"] = scaling
        return raw

    def _rope_scaling(self, head_dim: int, theta: float) -> dict | None:
        kind = self._meta("rope.scaling.type", None)
        if kind not in (None, "none"):
            raise ConfigError(f"{self.path}: rope scaling {kind!r} is not supported for GGUF Llama models")
        if "rope_freqs.weight" not in self._tensors:
            return None
        # Llama 3.1-3.3 GGUFs carry llama3 rope scaling as per-frequency divisors (rope_freqs); find
        # the parameters that produce them (the published low 1 / high 4, the original context
        # solved from a divisor between the two limits, or a power of two), or refuse.
        freqs = self._array("rope_freqs.weight").astype(np.float64)
        factor, low, high = float(freqs.max()), 1.0, 4.0
        candidates = {2**k for k in range(6, 18)}
        if factor > 1:
            inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
            for f, w in zip(freqs, 2 * math.pi / inv, strict=False):
                if 1 < f < factor:
                    smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
                    candidates.add(round(w * (smooth * (high - low) + low)))
        for original in sorted(candidates):
            want = llama3_rope_divisors(head_dim, theta, factor, low, high, original)
            if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-4, atol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
        raise ConfigError(
            f"{self.path}: its rope_freqs tensor matches no llama3 rope scaling (factor {factor:g}, low "
            "frequency factor 1, high 4, any original context)"
        )

    # --- tensors ------------------------------------------------------------------------------
    def _array(self, name: str) -> np.ndarray:
        """A tensor as stored (F16/BF16 kept, quantised types dequantised to float32), numpy shape."""
        t = self._tensors[name]
        kind = t.tensor_type.name
        shape = self.tensor_shape(name)
        if kind not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' has GGUF type {kind}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        data = np.asarray(t.data)
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
        """The GGUF's tokenizer as a ``tokenizers`` tokenizer.json (byte-level BPE)."""
        model = self.metadata.get("tokenizer.ggml.model")
        if model is None:
            raise CheckpointError(f"{self.path} carries no tokenizer (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise ConfigError(
                f"{self.path}: tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', is)"
            )
        pre = self.metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ConfigError(
                f"{self.path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
            )
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        merges = self.metadata.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise CheckpointError(f"{self.path}: the tokenizer's tokens or merges are missing")
        types = self.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        added = [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": kind != _CONTROL,
                "special": kind == _CONTROL,
            }
            for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
            if kind in (_CONTROL, _USER_DEFINED)
        ]
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        post: dict = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
        if self.metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            name = tokens[int(bos)]
            post = {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": name, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "pair": [
                    {"SpecialToken": {"id": name, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": name, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {name: {"id": name, "ids": [int(bos)], "tokens": [name]}},
            }
        spec = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": PRE_TOKENIZERS[pre],
            "post_processor": post,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {tok: i for i, tok in enumerate(tokens)},
                "merges": [m.split(" ", 1) for m in merges],
            },
        }
        return json.dumps(spec, ensure_ascii=False)

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


def llama3_rope_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling (what llama.cpp stores as ``rope_freqs``)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


class GGUFTensors:
    """A GGUF's tensors under hub names, in hub layouts: the reader interface of
    :class:`mtp_jax.checkpoint.safetensors_io.CheckpointReader` (``keys``, ``shape``, ``dtype``,
    ``get``). Query/key projections get their rows back in rotate-half order."""

    def __init__(self, ckpt: GGUFCheckpoint, progress: bool = False) -> None:
        self.ckpt = ckpt
        self.directory = ckpt.path
        self._bar = None
        if progress:
            from mtp_jax.progress import Progress

            names = [n for n in ckpt.tensor_names() if n != "rope_freqs.weight"]
            total = sum(ckpt.stored_bytes(n) for n in names)
            self._bar = Progress(f"load {os.path.basename(ckpt.path)}", len(names), total)
        self._names: dict[str, str] = {}  # hub name -> GGUF name
        for name in ckpt.tensor_names():
            if name == "rope_freqs.weight":  # read into the config (llama3 rope scaling)
                continue
            self._names[_hub_name(name)] = name

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
        x = self.ckpt._array(self._gguf(key))
        if self._bar is not None:
            self._bar.update(1, self.ckpt.stored_bytes(self._gguf(key)), key)
        proj = key.rsplit(".", 2)[-2] if key.endswith("_proj.weight") else None
        if (
            proj in ("q_proj", "k_proj") and self.ckpt.architecture == "llama"
        ):  # undo llama.cpp's per-head interleaving of the rope halves
            heads = int(self.ckpt._meta("attention.head_count"))
            n = heads if proj == "q_proj" else int(self.ckpt._meta("attention.head_count_kv", heads))
            rows, cols = x.shape
            x = np.ascontiguousarray(x.reshape(n, rows // n // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))
        return x

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for key in self._names:
            yield key, self.get(key)


def _hub_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return name  # kept under its own name: reported as unused (refused with strict)
