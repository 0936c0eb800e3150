"""Log-probabilities of generated and prompt tokens: the target's raw log-softmax at each position,
the same with every draft as without one, and refused when out of range."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

import mtp_jax
from mtp_jax.sampling import MAX_LOGPROBS
from tests.conftest import REPO

PROMPTS = [[1, 5, 9, 22, 7, 3, 11], [4, 4, 2]]
LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")


def raw_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log_softmax(model.logits) [len(tokens), V] at the positions that emitted ``tokens``."""
    logits = model.logits([prompt + tokens])[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def check_against_logits(model, prompts, tokens_of, logprobs_of, n: int) -> None:
    """Every new token's log-probability and top n are the target's raw log-softmax at its position."""
    assert logprobs_of is not None and len(logprobs_of) == len(prompts)
    for prompt, tokens, rows in zip(prompts, tokens_of, logprobs_of, strict=True):
        want = raw_logprobs(model, prompt, tokens)
        assert [r.token for r in rows] == tokens
        np.testing.assert_allclose([r.logprob for r in rows], want[np.arange(len(tokens)), tokens], atol=2e-5)
        for r, dist in zip(rows, want, strict=True):
            assert len(r.top) == n
            ids = [i for i, _ in r.top]
            np.testing.assert_allclose([lp for _, lp in r.top], dist[ids], atol=2e-5)
            # the n most likely, most likely first (ties at float32 resolution aside)
            assert np.all(np.diff([lp for _, lp in r.top]) <= 1e-6)
            if n:
                assert r.top[-1][1] >= np.sort(dist)[-n] - 2e-5


def test_logprobs_are_the_raw_distribution_with_and_without_mtp(oracle_model):
    """Greedy and sampled rows (raw logprobs: before temperature), plain and with the MTP draft
    (accepted often): the same tokens and the same log-probabilities."""
    kw = dict(max_new_tokens=12, ignore_eos=True, logprobs=3, temperature=[0.0, 0.8], seed=5)
    plain = oracle_model.generate(PROMPTS, **kw)
    check_against_logits(oracle_model, PROMPTS, plain.tokens, plain.logprobs, 3)
    spec = oracle_model.generate(PROMPTS, draft="mtp", num_speculative_tokens=3, **kw)
    assert spec.tokens == plain.tokens and spec.stats["acceptance_length"] > 1.5
    for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
        np.testing.assert_allclose([r.logprob for r in a], [r.logprob for r in b], atol=2e-5)
        assert [[i for i, _ in r.top] for r in a] == [[i for i, _ in r.top] for r in b]
    # only the rows that ask get them; n = 0: the chosen token's alone
    mixed = oracle_model.generate(
        PROMPTS,
        draft="ngram",
        num_speculative_tokens=3,
        max_new_tokens=8,
        ignore_eos=True,
        logprobs=[None, 0],
    )
    assert mixed.logprobs[0] is None and len(mixed.logprobs[1]) == 8
    assert all(r.top == () for r in mixed.logprobs[1])
    check_against_logits(oracle_model, PROMPTS[1:], mixed.tokens[1:], mixed.logprobs[1:], 0)
    assert oracle_model.generate(PROMPTS, max_new_tokens=4).logprobs is None  # none asked: none computed


def test_token_trees_give_the_raw_logprobs_along_the_accepted_path(oracle_model):
    """With a token tree each emitted token's log-probabilities are the target's raw ones at its
    position: read at the accepted path's nodes (a greedy row's tokens are plain decoding's)."""
    kw = dict(max_new_tokens=12, ignore_eos=True, logprobs=3, temperature=[0.0, 0.8], seed=5)
    tree = oracle_model.generate(
        PROMPTS, draft="mtp", speculative_tree={"depth": 3, "topk": 2, "nodes": 6}, **kw
    )
    assert tree.tokens[0] == oracle_model.generate(PROMPTS[:1], max_new_tokens=12, ignore_eos=True).tokens[0]
    assert tree.stats["acceptance_length"] > 1.5
    check_against_logits(oracle_model, PROMPTS, tree.tokens, tree.logprobs, 3)


def test_llama_drafts_give_plain_decodings_logprobs():
    """EAGLE-3, DFlash and the draft model on the embedded tiny Llama, K = 3: each emitted token's
    log-probability and alternatives equal plain decoding's."""
    target = mtp_jax.load(LLAMA, "float32")
    tok = Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in ("def read_config(path):\n", "import os\nimport sys\n")]
    kw = dict(max_new_tokens=16, ignore_eos=True, logprobs=2)
    plain = target.generate(prompts, **kw)
    check_against_logits(target, prompts, plain.tokens, plain.logprobs, 2)
    for method, suffix in (("eagle3", "eagle3"), ("dflash", "dflash"), ("draft_model", "draft")):
        model = target.with_draft(f"{LLAMA}-{suffix}")
        out = model.generate(prompts, draft=method, num_speculative_tokens=3, **kw)
        assert out.tokens == plain.tokens and out.stats["num_accepted_tokens"] > 0, method
        for a, b in zip(plain.logprobs, out.logprobs, strict=True):
            np.testing.assert_allclose(
                [r.logprob for r in a], [r.logprob for r in b], atol=2e-5, err_msg=method
            )
            np.testing.assert_allclose(
                [[lp for _, lp in r.top] for r in a], [[lp for _, lp in r.top] for r in b], atol=2e-5
            )


def test_prompt_logprobs(oracle_model):
    """Each prompt token after the first: its log-probability after the ones before it; None first."""
    prompt = PROMPTS[0]
    rows = oracle_model.prompt_logprobs(prompt, 4)
    want = np.asarray(jax.nn.log_softmax(oracle_model.logits([prompt])[0], axis=-1))
    assert rows[0] is None and len(rows) == len(prompt)
    for t in range(1, len(prompt)):
        assert rows[t].token == prompt[t] and len(rows[t].top) == 4
        assert rows[t].logprob == pytest.approx(float(want[t - 1, prompt[t]]), abs=2e-5)
        assert [i for i, _ in rows[t].top] == list(np.argsort(-want[t - 1])[:4])
    out = oracle_model.generate(PROMPTS, max_new_tokens=2, prompt_logprobs=[1, None])
    assert out.prompt_logprobs[1] is None
    got = out.prompt_logprobs[0]  # generate's, against the teacher-forced logits above
    assert got[0] is None and len(got) == len(prompt)
    for t in range(1, len(prompt)):
        assert got[t].token == prompt[t] and [i for i, _ in got[t].top] == [int(np.argmax(want[t - 1]))]
        assert got[t].logprob == pytest.approx(float(want[t - 1, prompt[t]]), abs=2e-5)


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.5, "3"])
def test_out_of_range_logprobs_are_refused(oracle_model, value):
    with pytest.raises(
        mtp_jax.InvalidRequestError, match=r"logprobs must be None or an integer in \[0, 20\]"
    ):
        oracle_model.generate(PROMPTS, max_new_tokens=2, logprobs=value)
    with pytest.raises(mtp_jax.InvalidRequestError, match="prompt_logprobs must be"):
        oracle_model.generate(PROMPTS, max_new_tokens=2, prompt_logprobs=value)
