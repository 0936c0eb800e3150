"""Plain decoding: cached decode == teacher-forced forward, batching invariance, one compilation,
stop conditions and input validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cache import PageAllocator, page_table_array
from mtp_jax.model import Model
from mtp_jax.sampling import RowSampling
from mtp_jax.step import StepConfig, forward_paged_jit, init_state, prefill, step
from mtp_jax.targets.deepseek_v3.model import init_cache

RNG = np.random.default_rng(1234)


def random_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    return [RNG.integers(2, vocab, n).tolist() for n in lengths]


def test_decode_logits_equal_teacher_forced(tiny_model):
    """Prefill ragged prompts, then feed a fixed continuation token by token: every step's logits
    equal the teacher-forced logits at that position (page size 4: many page boundaries)."""
    m, cfg, page = tiny_model, tiny_model.config, 4
    lengths, steps = [3, 9, 14], 11
    seqs = random_prompts(cfg.vocab_size, [n + steps for n in lengths])
    b, bucket = len(lengths), 16
    width = -(-(max(lengths) + steps) // page)
    alloc = PageAllocator(b * width + 5)
    alloc.allocate(5)  # rows get pages that do not start at 0
    table = jnp.asarray(page_table_array([alloc.allocate(width) for _ in range(b)], width))
    pages = init_cache(cfg, alloc.num_pages, page, jnp.float32)
    tokens = np.zeros((b, bucket), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = seqs[i][:n]
    positions = np.broadcast_to(np.arange(bucket, dtype=np.int32), (b, bucket))
    valid = positions < np.asarray(lengths)[:, None]
    _, logits, pages = forward_paged_jit(m.params, pages, cfg, page, tokens, positions, valid, table)
    got = [np.asarray(logits)[np.arange(b), np.asarray(lengths) - 1]]
    seq_lens = np.asarray(lengths, np.int32)
    for _ in range(steps):
        feed = np.array([[seqs[i][seq_lens[i]]] for i in range(b)], np.int32)
        ones = np.ones((b, 1), bool)
        _, logits, pages = forward_paged_jit(m.params, pages, cfg, page, feed, seq_lens[:, None], ones, table)
        got.append(np.asarray(logits)[:, 0])
        seq_lens = seq_lens + 1
    for i, n in enumerate(lengths):
        want = m.logits([seqs[i]])[0, n - 1 : n + steps]
        np.testing.assert_allclose(np.stack([g[i] for g in got]), want, rtol=1e-4, atol=1e-4)


def test_greedy_generate_equals_argmax_of_teacher_forced(tiny_model):
    prompts = random_prompts(tiny_model.config.vocab_size, [5, 12, 1])
    result = tiny_model.generate(prompts, max_new_tokens=10, ignore_eos=True)
    for prompt, new in zip(prompts, result.tokens, strict=True):
        assert len(new) == 10
        logits = tiny_model.logits([prompt + new])[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == new


def test_row_output_same_alone_and_in_batch(tiny_model):
    prompts = random_prompts(tiny_model.config.vocab_size, [7, 3, 11, 6, 2])
    batch = tiny_model.generate(prompts, max_new_tokens=9, ignore_eos=True)
    for i in (0, 2, 4):
        alone = tiny_model.generate([prompts[i]], max_new_tokens=9, ignore_eos=True)
        assert alone.tokens[0] == batch.tokens[i]


def test_decoding_compiles_once(tiny_model):
    prompts = random_prompts(tiny_model.config.vocab_size, [4, 6])
    before = step._cache_size()
    result = tiny_model.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert result.stats["steps"] >= 11
    assert step._cache_size() - before <= 1  # a dozen steps, at most one new executable
    seen = (step._cache_size(), prefill._cache_size())
    # 20 new tokens need 8 pages of 4 per row, the same power-of-two bucket as 12 did
    result = tiny_model.generate(prompts, max_new_tokens=20, ignore_eos=True)
    assert result.stats["steps"] >= 19
    assert (step._cache_size(), prefill._cache_size()) == seen


def test_prefill_pads_each_admission_to_its_own_prompts(tiny_model):
    """One slot, a 40-token prompt then a short one: the short one is prefilled in the 16-token
    program, not padded to the long one's 64 (prefill cost grows with the padded length)."""
    short, long_ = random_prompts(tiny_model.config.vocab_size, [5, 40])
    kw = dict(max_new_tokens=3, ignore_eos=True, max_batch=1)
    want = [tiny_model.generate([p], **kw).tokens[0] for p in (long_, short)]
    jax.clear_caches()
    assert prefill._cache_size() == 0
    result = tiny_model.generate([long_, short], **kw)
    assert result.stats["prefill_calls"] == 2 and result.tokens == want
    assert prefill._cache_size() == 2  # 64 and 16 tokens


def test_decode_state_is_donated(tiny_model):
    sc = StepConfig(tiny_model.config, 4)
    state = init_state(sc, 2, 8, 4, jnp.float32)
    _, state2, _ = prefill(
        tiny_model.params,
        state,
        sc,
        jnp.array([0, 1]),
        np.ones((2, 16), np.int32),
        jnp.array([3, 5]),
        jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]]),
        RowSampling.build(2),
    )
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    _, _, state3, _ = step(tiny_model.params, state2, sc)
    jax.block_until_ready(state3)
    assert all(x.is_deleted() for x in jax.tree.leaves(state2))


def test_stops_at_eos_and_drops_nothing_before_it(tiny_model):
    prompt = random_prompts(tiny_model.config.vocab_size, [6])
    free = tiny_model.generate(prompt, max_new_tokens=12, ignore_eos=True).tokens[0]
    eos = free[4]
    stop_at = free.index(eos)
    m = Model(tiny_model.config, tiny_model.params, dtype="float32", eos_token_ids=[eos], page_size=4)
    result = m.generate(prompt + random_prompts(m.config.vocab_size, [3]), max_new_tokens=12)
    assert result.tokens[0] == free[: stop_at + 1]
    assert result.finish_reasons[0] == "eos"
    assert m.generate(prompt, max_new_tokens=12, ignore_eos=True).finish_reasons == ["length"]


def test_max_new_tokens_one(tiny_model):
    prompt = random_prompts(tiny_model.config.vocab_size, [4])
    result = tiny_model.generate(prompt, max_new_tokens=1)
    assert len(result.tokens[0]) == 1 and result.stats["steps"] == 0
    assert result.request_stats[0]["time_to_first_token_seconds"] > 0
    assert result.request_stats[0]["time_per_output_token_seconds"] is None  # no decoding
    assert result.stats["mean_time_per_output_token_seconds"] is None
    assert result.tokens[0][0] == int(tiny_model.logits(prompt)[0, -1].argmax())


def test_stats(tiny_model):
    result = tiny_model.generate(
        random_prompts(tiny_model.config.vocab_size, [3, 4, 5]), max_new_tokens=6, ignore_eos=True
    )
    st = result.stats
    # the first token comes from the prefill, then one step per token, and no step past the end
    assert st["new_tokens"] == 18 and st["prompt_tokens"] == 12 and st["steps"] == 5
    assert st["tokens_per_second"] > 0 and st["acceptance_length"] == 1.0
    # the decode rates count the 15 tokens the steps emitted (the 3 first tokens come from the
    # prefill), over the decode time, and over it without the first step call
    assert 0 < st["first_step_call_seconds"] < st["decode_seconds"]
    assert st["decode_tokens_per_second"] * st["decode_seconds"] == pytest.approx(15)
    after = st["decode_seconds"] - st["first_step_call_seconds"]
    assert st["decode_tokens_per_second_after_first_call"] * after == pytest.approx(15)


def test_request_latencies(tiny_model):
    """Each request's time to first token and time per output token: one slot, so the second request
    waits for the whole of the first (its TTFT covers the first's decoding); the run's stats hold
    their means. (One new token has no TPOT: test_max_new_tokens_one.)"""
    prompts = random_prompts(tiny_model.config.vocab_size, [3, 5])
    result = tiny_model.generate(prompts, max_new_tokens=7, ignore_eos=True, max_batch=1)
    first, second = result.request_stats
    assert first["time_to_first_token_seconds"] > 0 and first["time_per_output_token_seconds"] > 0
    assert second["time_to_first_token_seconds"] > 6 * first["time_per_output_token_seconds"]
    for key in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert result.stats[f"mean_{key}"] == pytest.approx((first[key] + second[key]) / 2)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "match"),
    [
        ([[1, 2, 97]], {}, "token id 97"),
        ([[1, -1]], {}, "token id -1"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([], {}, "non-empty"),
        ("hello", {}, "non-empty list"),
        ([[1, 2.5]], {}, "not an integer"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1] * 200], {"max_new_tokens": 57}, "maximum length 256"),
        ([[1, 2]], {"temperature": -0.5}, "temperature"),
        ([[1, 2]], {"top_p": 0.0}, "top_p"),
        ([[1, 2]], {"top_k": -1}, "top_k"),
        ([[1, 2]], {"min_p": 1.0}, "min_p"),
        ([[1, 2], [3]], {"seed": [1, 2, 3]}, "seed has 3 values for 2 prompts"),
    ],
)
def test_bad_requests_are_named_and_model_stays_usable(tiny_model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model.generate(prompts, **kwargs)
    assert len(tiny_model.generate([[5, 6]], max_new_tokens=2).tokens[0]) >= 1


@pytest.mark.parametrize(
    ("token_ids", "match"),
    [
        ([[1, 2, 400]], "token id 400"),
        ([], "non-empty"),
        ([[1.0, 2.0]], "integers"),
        ([[1] * 257], "exceeds"),
    ],
)
def test_bad_logits_input(tiny_model, token_ids, match):
    with pytest.raises(mtp_jax.InvalidRequestError, match=match):
        tiny_model.logits(token_ids)


def test_bfloat16_model_generates(make_checkpoint):
    path = make_checkpoint()
    m16 = mtp_jax.load(path, dtype="bfloat16", page_size=4)
    m32 = mtp_jax.load(path, dtype="float32", page_size=4)
    ids = [[5, 9, 13, 2, 40, 41, 42]]
    l16, l32 = m16.logits(ids), m32.logits(ids)
    assert l16.dtype == np.float32
    assert np.linalg.norm(l16 - l32) / np.linalg.norm(l32) < 0.05
    result = m16.generate(ids, max_new_tokens=5, ignore_eos=True)
    assert len(result.tokens[0]) == 5
