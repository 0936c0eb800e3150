"""A GGUF file's tokenizer as a ``tokenizers`` tokenizer.json: byte-level BPE
(``tokenizer.ggml.model = gpt2``, with the pre-tokenizers we can express) or SentencePiece BPE
(``llama``, encoded as llama.cpp's SPM session does)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from mtp_jax.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from mtp_jax.checkpoint.gguf import GGUFCheckpoint

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

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # tokenizer.ggml.token_type values


def _added_token(i: int, content: str, *, normalized: bool, special: bool) -> dict:
    """One entry of tokenizer.json's ``added_tokens``: matched whole before the model runs."""
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": normalized,
        "special": special,
    }


def _byte_level_json(self: GGUFCheckpoint) -> str:
    """A byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``: tokens, merges, types)."""
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
        _added_token(i, tok, normalized=kind != _CONTROL, special=kind == _CONTROL)
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    post = _bos_template(self, tokens) or byte_level
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


def _bos_template(self: GGUFCheckpoint, tokens: list[str]) -> dict | None:
    """A post-processor putting BOS first when the file says ``add_bos_token`` (else None)."""
    bos = self.metadata.get("tokenizer.ggml.bos_token_id")
    if not self.metadata.get("tokenizer.ggml.add_bos_token", False) or bos is None:
        return None
    name = tokens[int(bos)]
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": name, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": name, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {name: {"id": name, "ids": [int(bos)], "tokens": [name]}},
    }


def _score_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """Every split (a, b) of a NORMAL token into two NORMAL tokens, the highest-scored token's
    first (ties by id): as BPE merges they reproduce SentencePiece's score-ordered merging."""
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == _NORMAL}
    merges = []
    for tok, i in normal.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in normal and right in normal:
                merges.append((-float(scores[i]), i, left, right))
    merges.sort()
    return [[left, right] for _, _, left, right in merges]


def _sentencepiece_json(self: GGUFCheckpoint) -> str:
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model = llama``: tokens, scores, types)
    as a ``tokenizers`` BPE that encodes as llama.cpp's SPM session does:

    1. the text of every CONTROL, USER_DEFINED and UNKNOWN token is split out first (added
       tokens matched on the raw text; user-defined ones, such as Gemma's runs of spaces and
       HTML tags, are stored with literal spaces and so match them);
    2. the rest has each space replaced by U+2581 (and one prepended with
       ``add_space_prefix``);
    3. adjacent symbols merge while some pair forms a NORMAL token, the pair whose token has
       the highest score first, the leftmost among equals: every split (a, b) of a normal token
       into two normal tokens is a merge ranked by that token's score;
    4. a character no token holds is emitted as its UTF-8 bytes' ``<0xXX>`` tokens.

    Decoding maps U+2581 back to a space and fuses byte tokens."""
    tokens = self.metadata.get("tokenizer.ggml.tokens")
    scores = self.metadata.get("tokenizer.ggml.scores")
    types = self.metadata.get("tokenizer.ggml.token_type")
    if not (isinstance(tokens, list) and isinstance(scores, list) and isinstance(types, list)):
        raise CheckpointError(
            f"{self.path}: the SentencePiece tokenizer's tokens, scores or types are missing"
        )
    if not len(tokens) == len(scores) == len(types):
        raise CheckpointError(
            f"{self.path}: {len(tokens)} tokens but {len(scores)} scores and {len(types)} token types"
        )
    merges = _score_merges(tokens, scores, types)
    added = [
        _added_token(i, tok, normalized=False, special=kind != _USER_DEFINED)
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED, _UNKNOWN) and tok
    ]
    unk = self.metadata.get("tokenizer.ggml.unknown_token_id")
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    if self.metadata.get("tokenizer.ggml.add_space_prefix", False):
        normalizers.insert(0, {"type": "Prepend", "prepend": "\u2581"})
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": _bos_template(self, tokens),
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None if unk is None else tokens[int(unk)],
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    return json.dumps(spec, ensure_ascii=False)


_BUILDERS = {"gpt2": _byte_level_json, "llama": _sentencepiece_json}
"""tokenizer.ggml.model -> the builder of its tokenizer.json."""


def tokenizer_json(ckpt: GGUFCheckpoint) -> str:
    """``ckpt``'s tokenizer as a ``tokenizers`` tokenizer.json (its ``tokenizer.ggml.model``'s builder)."""
    model = ckpt.metadata.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError(f"{ckpt.path} carries no tokenizer (tokenizer.ggml.model is missing)")
    if model not in _BUILDERS:
        raise ConfigError(
            f"{ckpt.path}: tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', and "
            "SentencePiece BPE, 'llama', are)"
        )
    return _BUILDERS[model](ckpt)
