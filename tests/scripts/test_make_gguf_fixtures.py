"""scripts/make_gguf_fixtures.py: the tokenizer it gives llama.cpp's converter has exactly the
checkpoint's vocabulary, its specials where the config puts them, and round-trips text."""

from __future__ import annotations

import importlib.util
import json
import os

from tokenizers import Tokenizer

from tests.conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_gguf_fixtures", os.path.join(REPO, "scripts", "make_gguf_fixtures.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_byte_level_tokenizer_has_the_vocabulary_size_and_round_trips():
    make = _script().byte_level_tokenizer
    spec = make(128, {1: "<s>", 2: "</s>"})
    assert json.dumps(spec) == json.dumps(make(128, {1: "<s>", 2: "</s>"}))  # deterministic
    vocab = spec["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(128)) and vocab["<s>"] == 1 and vocab["</s>"] == 2
    tok = Tokenizer.from_str(json.dumps(spec))
    text = "def f(x):\n    return x + 1  # ok"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges apply
