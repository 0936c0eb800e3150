"""The shipped tiny Llama 3 (checkpoints/tiny-llama3-stdlib, trained by scripts/train_tiny.py
--arch llama) is what its card says: a Llama 3 checkpoint in the hub layout, trained on the same
text and tokenizer as the default model, that writes Python-looking code."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer

import mtp_jax
from mtp_jax.cli import main as cli_main
from tests.conftest import EMBEDDED_MODEL, REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")


@pytest.fixture(scope="module")
def shipped():
    model = mtp_jax.load(LLAMA, "float32", strict=True)
    tok = Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
    with open(os.path.join(LLAMA, "eval.json"), encoding="utf-8") as f:
        report = json.load(f)
    return model, tok, report


def test_is_a_llama_3_with_the_default_models_tokenizer(shipped):
    model, _, report = shipped
    assert model.config.model_type == "llama" and model.config.rope_scaling is not None
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.drafts == ()
    with (
        open(os.path.join(LLAMA, "tokenizer.json"), "rb") as a,
        open(os.path.join(EMBEDDED_MODEL, "tokenizer.json"), "rb") as b,
    ):
        assert a.read() == b.read()
    with open(os.path.join(EMBEDDED_MODEL, "eval.json"), encoding="utf-8") as f:
        default = json.load(f)
    assert report["heldout_modules"] == default["heldout_modules"]  # the same split


def test_heldout_perplexity_is_below_the_bound_recorded_at_training(shipped):
    model, tok, report = shipped
    ids = tok.encode(report["snippet"]["text"]).ids
    ppl = model.score(ids).perplexity
    assert ppl <= report["snippet"]["perplexity"] * 1.01
    assert ppl < model.config.vocab_size / 20  # trained: an untrained model sits near the vocabulary size


def test_cli_generates_python_looking_code(capsys):
    argv = ["generate", "--model", LLAMA, "--prompt", "def fibonacci(n):", "--max-new-tokens", "24"]
    assert cli_main(argv) == 0
    out = capsys.readouterr()
    text = out.out
    assert text.startswith("def fibonacci(n):") and len(text) > len("def fibonacci(n):") + 10
    assert any(mark in text for mark in ("return", "if ", "    ", "(", "="))
    assert "acceptance length 1.00" in out.err  # plain decoding: no draft
