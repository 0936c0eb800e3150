"""Text in and out: streaming detokenisation never splits a character and adds up to the whole
decode, stop strings across token boundaries, chat templates rendered by Jinja2 from a
hub-layout tokenizer_config.json, and text prompts / stop strings through generate."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from tokenizers import Tokenizer

import mtp_jax
from mtp_jax.text import IncrementalDecoder, StopStrings, TextCodec, check_stops
from tests.conftest import EMBEDDED_MODEL, REPO, real_model, require_extra

TEXTS = [
    "def f(x):\n    return x  # ok",
    "naïve café — 東京 🚀🚀 ünïcödé",  # multi-byte characters split over byte-level tokens
    "   leading spaces\n\n\ttabs",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(os.path.join(EMBEDDED_MODEL, "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_adds_up_and_never_splits_a_character(tok, text):
    ids = tok.encode(text).ids
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(t) for t in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    if any(len(ch.encode()) > 1 for ch in text):  # some token ends inside a character
        assert "" in pieces[:-1]


def test_a_cut_character_at_the_end_is_flushed_as_a_replacement(tok):
    ids = tok.encode("🚀").ids
    assert len(ids) > 1  # the byte-level tokenizer splits it
    dec = IncrementalDecoder(tok)
    assert [dec.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert "\ufffd" in dec.flush()


@pytest.mark.parametrize(
    ("pieces", "stops", "out", "stopped"),
    [
        (["hello wo", "rld. bye"], ["world"], "hello ", True),
        (["a", "b", "c", "d"], ["bc"], "a", True),
        (["ab", "x"], ["abc"], "abx", False),  # a held-back prefix released when it is not a stop
        (["x END", "MARK y"], ["ENDMARK", "MARK"], "x ", True),  # the earliest stop wins
        (["no stop here"], ["zz"], "no stop here", False),
    ],
)
def test_stop_strings(pieces, stops, out, stopped):
    s = StopStrings(stops)
    got = "".join(s.push(p) for p in pieces) + s.flush()
    assert (got, s.stopped) == (out, stopped)


def test_check_stops():
    assert check_stops(None) == [] and check_stops("a") == ["a"] and check_stops(["a", "b"]) == ["a", "b"]
    for bad in ("", [""], [1], ["x"] * 17, {"a": 1}):
        with pytest.raises(mtp_jax.InvalidRequestError, match="stop"):
            check_stops(bad)


# A Llama-3-style chat template (our own text, in the hub's tokenizer_config.json layout).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    require_extra("jinja2")
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(EMBEDDED_MODEL, path)
    config = {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_chat_template(chat_model_dir):
    codec = TextCodec.from_dir(chat_model_dir)
    msgs = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert codec.render_chat(msgs) == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert codec.render_chat(msgs, add_generation_prompt=False).endswith("hi<|end|>\n")
    with pytest.raises(mtp_jax.InvalidRequestError, match="refused the messages: bad role tool"):
        codec.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(mtp_jax.InvalidRequestError, match="non-empty list"):
        codec.render_chat([])
    with pytest.raises(mtp_jax.InvalidRequestError, match="only text content parts"):
        codec.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(mtp_jax.InvalidRequestError, match="no chat template"):
        TextCodec.from_dir(EMBEDDED_MODEL).render_chat(msgs)


def test_text_prompts_and_stop_strings_through_generate(tok):
    model = mtp_jax.load(EMBEDDED_MODEL, "float32")
    text = "def main():\n"
    ids = tok.encode(text).ids
    by_ids = model.generate([ids], max_new_tokens=24, ignore_eos=True)
    by_text = model.generate([text], max_new_tokens=24, ignore_eos=True, draft="mtp")
    assert by_text.tokens == by_ids.tokens
    full = tok.decode(by_ids.tokens[0])
    assert by_text.texts == [full]
    stop = full[5:9]  # a stop string somewhere inside the output, likely across tokens
    cut = model.generate([text], max_new_tokens=24, ignore_eos=True, stop=[stop], draft="mtp")
    assert cut.finish_reasons == ["stop"] and cut.texts == [full[: full.index(stop)]]
    assert tok.decode(cut.tokens[0]).find(stop) >= 0  # the tokens go up to the one completing it
    assert cut.tokens[0] == by_ids.tokens[0][: len(cut.tokens[0])]


REFERENCE = os.path.join(REPO, "tests", "fixtures", "tokenizers.json")


@pytest.mark.parametrize("name", ["tiny-llama3-stdlib", "tiny-deepseek-v3-stdlib", "smollm2-135m-instruct"])
def test_text_and_chats_encode_as_transformers_does(name):
    """Prompts (BOS or not by the tokenizer's own rule) and rendered chats equal what transformers'
    AutoTokenizer and apply_chat_template(add_generation_prompt=True) gave
    (scripts/make_tokenizer_fixtures.py); SmolLM2 through its GGUF's own tokenizer."""
    with open(REFERENCE, encoding="utf-8") as f:
        ref = json.load(f)["models"][name]
    if name.startswith("tiny"):
        codec = TextCodec.from_dir(os.path.join(REPO, "checkpoints", name))
    else:
        require_extra("gguf")
        require_extra("jinja2")
        codec = TextCodec.for_path(real_model(name))
    for case in ref["texts"]:
        assert codec.encode(case["text"]) == case["ids"], case["text"]
    bos = codec.tokenizer.token_to_id("<|bos|>")
    assert (ref["texts"][0]["ids"][0] == bos) == name.startswith("tiny")  # SmolLM2 adds no BOS
    for case in ref.get("chats", []):
        assert codec.render_chat(case["messages"]) == case["text"]
        assert codec.encode_chat(case["messages"]) == case["ids"]
    assert name.startswith("tiny") or ref.get("chats")
