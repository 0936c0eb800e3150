"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``, not by us: see
``scripts/make_gguf_fixtures.py``) from the Llama-family parity checkpoints: read by our GGUF
reader, their logits equal what ``transformers`` computed on the hub checkpoints they came from.
This is what proves the q/k row permutation (Llama's, which the converter applies and we undo;
Qwen2 has none), the llama3 ``rope_freqs`` tensor and the metadata names, with no optional
package installed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.gguf import GGUFCheckpoint
from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")


@pytest.mark.parametrize("name", ["llama3_gqa42", "qwen2_bias_tied"])
def test_llama_cpp_converted_ggufs_give_transformers_logits(name):
    hub = os.path.join(FIXTURES, "parity_llama", name)
    path = os.path.join(FIXTURES, "gguf", f"{name}.gguf")
    with open(os.path.join(hub, "config.json")) as f:
        raw = json.load(f)
    cfg = GGUFCheckpoint(path).hf_config()
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert cfg[key] == raw[key], key
    assert cfg.get("rope_scaling") == raw.get("rope_scaling")
    ref = np.load(os.path.join(hub, "reference.npz"))
    model = mtp_jax.load(path, "float32", strict=True)
    assert model.config.tie_word_embeddings == raw.get("tie_word_embeddings", False)
    ids = ref["input_ids"].tolist()
    np.testing.assert_allclose(model.logits(ids), ref["logits"], rtol=1e-4, atol=1e-4)
