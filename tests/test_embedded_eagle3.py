"""The shipped EAGLE-3 drafts (checkpoints/*-eagle3, trained by scripts/train_eagle3.py) are what
their cards say: published-layout drafts that load strictly beside their targets, are accepted
often enough that every acceptance length occurs, and leave greedy output exactly plain decoding's."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from tests.conftest import EMBEDDED_MODEL, REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
PAIRS = {
    "llama": (LLAMA, LLAMA + "-eagle3"),
    "deepseek": (EMBEDDED_MODEL, EMBEDDED_MODEL + "-eagle3"),
}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def shipped(request):
    target, draft = PAIRS[request.param]
    model = mtp_jax.load(target, "float32", strict=True, draft_model=draft)
    tok = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
    with open(os.path.join(draft, "eval.json"), encoding="utf-8") as f:
        report = json.load(f)
    prompts = [[model.config.bos_token_id, *tok.encode(t).ids] for t in report["prompts"][:6]]
    plain = model.generate(prompts, max_new_tokens=32, max_batch=3, ignore_eos=True)
    return request.param, model, report, prompts, draft, plain


def test_is_a_published_layout_eagle3_draft(shipped):
    name, model, report, _, draft, _ = shipped
    cfg = model.draft_config
    assert (cfg.mla is not None) == (name == "deepseek")  # the target's attention kind
    assert cfg.draft_vocab_size < cfg.vocab_size and len(set(cfg.capture)) == 3
    keys = CheckpointReader(draft).keys()
    assert {"fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d"} <= set(keys)
    assert all(k.startswith("layers.0.") for k in keys if k.count(".") > 1)
    assert "embed_tokens.weight" not in keys  # the target's embedding is used
    assert list(cfg.aux_layer_ids) == report["draft"]["layer_ids"]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_is_lossless_and_every_acceptance_length_occurs(shipped, k):
    _, model, _, prompts, _, plain = shipped
    spec = model.generate(
        prompts, max_new_tokens=32, max_batch=3, ignore_eos=True, draft="eagle3", num_speculative_tokens=k
    )
    assert spec.tokens == plain.tokens
    # rates strictly decreasing inside (0, 1): some step accepted exactly j drafts, for every j in 0..K
    rates = spec.stats["acceptance_rate_per_position"]
    assert rates[-1] > 0.0 and rates[0] < 1.0
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False)), rates


def test_acceptance_recorded_at_training_is_reproduced(shipped):
    """eval.json's K = 3 acceptance length (greedy, 64 new tokens, the target's held-out prompts)
    through the public API on the shipped weights."""
    _, model, report, _, _, _ = shipped
    tok_prompts = report["prompts"]
    tok = Tokenizer.from_file(os.path.join(model.path, "tokenizer.json"))
    ids = [[model.config.bos_token_id, *tok.encode(t).ids] for t in tok_prompts]
    out = model.generate(ids, max_new_tokens=64, draft="eagle3", num_speculative_tokens=3, max_batch=8)
    assert out.stats["acceptance_length"] == pytest.approx(report["acceptance"]["3"], rel=0.02)
