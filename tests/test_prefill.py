"""How prompts reach the caches, for both targets and every draft.

Automatic prefix caching: the page digests and their reference counts (mtp_jax.cache.PrefixCache),
and engines whose requests share prompt prefixes: each request's caches, tokens, log-probabilities
and acceptance counts equal the same request prefilled whole (a salt of its own: nothing cached),
the hits are the pages expected, and every page comes back. Chunked prefill: a long prompt written
a chunk per iteration leaves the caches and tokens of one whole prefill, while a running request
goes on emitting tokens (counted, not timed)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cache import PrefixCache, ShardedPageAllocator
from mtp_jax.request import SpeculativeConfig, step_config
from mtp_jax.sampling import RowSampling
from mtp_jax.scheduler import TIMINGS, Request, Scheduler, pages_needed
from tests.conftest import EMBEDDED_MODEL, REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
MAX_LEN = 128  # the engines' and schedulers' (the same programs: compiled once)

# --- the host side -----------------------------------------------------------------------------


def test_digests_name_whole_prefixes_and_the_lookahead():
    cache = PrefixCache(ShardedPageAllocator(16), page_size=4)
    ahead = PrefixCache(ShardedPageAllocator(16), page_size=4, lookahead=1)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages, each with a token after it
    d = cache.digests(prompt)
    assert len(d) == 3 and len(set(d)) == 3
    assert cache.digests(prompt[:12]) == d[:2]  # the last token is always prefilled
    assert ahead.digests(prompt[:9]) == ahead.digests(prompt)[:2]  # page 1 needs token 8 after it
    assert cache.digests(prompt, b"lora:1") != d and all(x not in d for x in cache.digests(prompt, b"x"))
    other = prompt[:5] + [99] + prompt[6:]  # differs inside page 1: page 0 still shared
    assert cache.digests(other)[0] == d[0] and not set(cache.digests(other)[1:]) & set(d)
    at_edge = prompt[:4] + [99] + prompt[5:]  # differs at page 1's first token
    assert cache.digests(at_edge)[0] == d[0]  # a cache that does not look ahead shares page 0...
    assert ahead.digests(at_edge)[0] != ahead.digests(prompt)[0]  # ...one that reads token 4 there does not


def test_pages_are_counted_kept_and_evicted_least_recently_released_first():
    allocator = ShardedPageAllocator(8, shards=2)  # pages 0-3 on shard 0, 4-7 on shard 1
    cache = PrefixCache(allocator, page_size=2)
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 4, 6]  # two shared pages
    da = cache.digests(a)
    pages_a, hit = cache.take(da, 3)
    assert hit == 0 and len(pages_a) == 3 and cache.free == 1 + 4
    cache.register(da, pages_a)
    pages_b, hit = cache.take(cache.digests(b), 3)
    assert hit == 2 and pages_b[:2] == pages_a[:2] and pages_b[2] != pages_a[2] and cache.free == 4
    assert (cache.queries, cache.hits) == (8, 4)
    assert cache.take(cache.digests(a), 1, shard=1)[1] == 0  # another shard's pages are not shared
    cache.release(pages_a)  # b still holds the shared pages; a's own third page is free again
    assert cache.free == 1 + 3 and cache.cached == 2
    cache.release(pages_b)  # nobody holds them: still cached, and counted free
    assert cache.free == 4 + 3 and cache.cached == 2
    again, hit = cache.take(cache.digests(a), 3)
    assert hit == 2 and again[:2] == pages_a[:2]
    cache.release(again)  # page 0 released before page 1: the older of the two
    # pressure: 3 fresh pages on shard 0 take its 2 free ones, then evict the oldest cached page
    cache.take(cache.digests([7, 7, 7, 7, 7]), 3)
    assert cache.cached == 1 and pages_a[1] in cache._digest_of and pages_a[0] not in cache._digest_of
    assert cache.take(cache.digests(a), 1)[1] == 0  # its first page is gone, so is the prefix


def test_named_pages_stay_their_first_owners():
    cache = PrefixCache(ShardedPageAllocator(8), page_size=2)
    d = cache.digests([1, 2, 3])
    p, _ = cache.take(d, 2)
    q, _ = cache.take(d, 2)  # admitted in the same prefill: nothing named yet
    cache.register(d, p)
    cache.register(d, q)  # the digest keeps p's page; q's stays q's own
    cache.release(q)
    assert cache.cached == 1 and cache.free == 8 - 2
    cache.release(p)
    assert cache.free == 8 and cache.cached == 1


# --- engines -----------------------------------------------------------------------------------


def _run(engine, prompt, **kw):
    return engine.submit(prompt, max_new_tokens=10, ignore_eos=True, logprobs=1, **kw).result(timeout=300)


def counters(completion) -> dict:
    """A completion's speculation counters (its stats without the latencies, which differ by run)."""
    return {k: v for k, v in completion.stats.items() if k not in TIMINGS}


def _hits(engine) -> int:
    return engine.stats()["prefix_cache_hits"]


def check_shared_prefixes(engine, lookahead: int, think: int | None = None) -> None:
    """Four requests sharing a 2.5-page prefix, one after another, each also run with a salt of its
    own (prefilled whole): equal tokens, log-probabilities and acceptance counts; the hits are the
    pages of the longest shared prefix (a draft that reads one token ahead shares a page only when
    the token after it agrees too); all pages free at the end. With ``think`` (the engine's thinking
    start marker) the prefix opens a thinking phase and the requests accept relaxed there."""
    page = engine.model.page_size
    rng = np.random.default_rng(1)
    system = [int(t) for t in rng.integers(7, 250, 2 * page + page // 2)]
    kw = {}
    if think is not None:
        system[3] = think  # a thinking phase opens inside the cached prefix
        kw = {"relaxed_topk": 8, "relaxed_delta": 0.9}
    tail = [[int(t) for t in rng.integers(7, 250, 3 + i)] for i in range(3)]
    edge = system[: 2 * page] + [system[2 * page] + 1] + tail[2]  # differs at page 2's first token
    prompts = [system + tail[0], system + tail[1], edge, system + tail[0]]
    full = ((len(prompts[0]) - 1) // page) * page
    want_hits = [0, 2 * page, page if lookahead else 2 * page, full]
    accepted = {"num_draft_tokens": 0, "num_accepted_tokens": 0}
    for i, prompt in enumerate(prompts):
        sampled = {"temperature": 0.8, "seed": i} if i % 2 else {}
        whole = _run(engine, prompt, cache_salt=f"alone {i}", **sampled, **kw)
        before = _hits(engine)
        cached = _run(engine, prompt, **sampled, **kw)
        assert _hits(engine) - before == want_hits[i], i
        assert cached.tokens == whole.tokens, i
        assert counters(cached) == counters(whole), i  # the same drafts proposed and accepted
        for key in accepted:
            accepted[key] += counters(whole)[key]
        np.testing.assert_allclose(
            [e.logprob for e in cached.logprobs], [e.logprob for e in whole.logprobs], atol=2e-5
        )
    # drafts were proposed and accepted over these requests: the equalities above are not vacuous
    assert accepted["num_draft_tokens"] > 0 and accepted["num_accepted_tokens"] > 0, accepted
    if think is not None:  # the phase matters: strict acceptance gives other tokens
        assert _run(engine, prompts[0], cache_salt="strict").tokens != _run(engine, prompts[0], **kw).tokens
    stats = engine.stats()
    assert stats["free_pages"] == stats["num_pages"] and stats["prefix_caching"]
    assert stats["prefix_cache_queries"] > stats["prefix_cache_hits"] > 0


def _prompt_rows(sched: Scheduler, req: Request) -> list[np.ndarray]:
    """Every cache leaf's entries (the target's and the draft's) at ``req``'s prompt positions."""
    page = sched.sc.page_size
    table = np.asarray(sched.pages_of[req.id])
    positions = np.arange(len(req.prompt))
    pages, offsets = table[positions // page], positions % page
    out = []
    for leaf in jax.tree.leaves((sched.state.target_pages, sched.state.draft_state)):
        x = np.asarray(leaf)
        axis = next(a for a in range(x.ndim - 1) if x.shape[a : a + 2] == (sched.allocator.num_pages, page))
        out.append(np.moveaxis(x, (axis, axis + 1), (0, 1))[pages, offsets])
    return out


def check_caches_after_a_hit(model, draft: str | None, lookahead: int) -> None:
    """After a request that shares the first two pages of another's prompt and differs at the token
    right after them is admitted, every cache (the target's, the draft's) holds at its prompt
    positions what the same request admitted alone writes: a draft that reads one token ahead gets
    the first page only (the second's last entry was computed with another next token)."""
    page = model.page_size
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(3, 250, 3 * page)]
    edge = first[: 2 * page] + [first[2 * page] + 1] + [int(t) for t in rng.integers(3, 250, 5)]
    sc = step_config(model, SpeculativeConfig(draft=draft, num_speculative_tokens=3 if draft else None))

    def admitted_after(prefix_caching: bool, earlier: list[int] | None):
        sched = Scheduler(
            model.params, sc, slots=2, width=pages_needed(MAX_LEN, 0, sc), eos_token_ids=(),
            cache_dtype=jnp.float32, prefix_caching=prefix_caching,
        )  # fmt: skip
        if earlier is not None:
            sched.submit(Request(earlier, 3, RowSampling.build(1), logprobs=1))
            while sched.advance():
                pass
        req = sched.submit(Request(edge, 3, RowSampling.build(1), logprobs=1))
        sched.admissions.admit()
        return sched, req

    cached, req = admitted_after(True, first)
    assert cached.prefix.hits == (page if lookahead else 2 * page)
    alone, req_alone = admitted_after(False, None)
    for got, want in zip(_prompt_rows(cached, req), _prompt_rows(alone, req_alone), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def check_reply_cached(model, draft: str | None) -> None:
    """A finished request names the full pages of its prompt and reply: the next turn (its prompt
    and reply, then a new message) hits all of them, its caches (the target's, the draft's) hold
    what the same prompt prefilled alone writes, and its tokens are the same."""
    page = model.page_size
    rng = np.random.default_rng(7)
    first = [int(t) for t in rng.integers(7, 250, page + page // 2)]
    sc = step_config(model, SpeculativeConfig(draft=draft, num_speculative_tokens=3 if draft else None))

    def scheduler(prefix_caching: bool) -> Scheduler:
        return Scheduler(
            model.params, sc, slots=2, width=pages_needed(MAX_LEN, 0, sc), eos_token_ids=(),
            cache_dtype=jnp.float32, prefix_caching=prefix_caching,
        )  # fmt: skip

    cached = scheduler(True)
    turn1 = cached.submit(Request(first, 2 * page, RowSampling.build(1)))
    while cached.advance():
        pass
    text = first + turn1.tokens
    named = len(cached.prefix.digests(text))
    assert named * page > len(first)  # pages of the reply are named, not only the prompt's
    turn2 = text + [int(t) for t in rng.integers(7, 250, 5)]
    runs = []
    for sched in (cached, scheduler(False)):
        req = sched.submit(Request(turn2, 4, RowSampling.build(1), logprobs=1))
        sched.admissions.admit()
        runs.append((_prompt_rows(sched, req), req, sched))
    assert cached.prefix.hits == named * page
    for got, want in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for _, _, sched in runs:
        while sched.advance():
            pass
    assert runs[0][1].tokens == runs[1][1].tokens and len(runs[0][1].tokens) == 4
    assert cached.free_pages == cached.allocator.num_pages


def check_chunked(model, draft: str | None, tree: dict | None = None) -> None:
    """A request runs while a 5.5-page prompt arrives 16 tokens per iteration (after a cached first
    page it shares with the running one): the running request emits tokens between the chunks;
    both requests' tokens, and the long prompt's caches, are those of one whole prefill (with
    ``tree``: speculating with that token tree)."""
    page = model.page_size
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(7, 250, 5 * page + page // 2)]
    running = prompt[: page + 4] + [int(t) for t in rng.integers(7, 250, 6)]  # shares the first page
    k = None if draft is None or tree is not None else 3
    sc = step_config(model, SpeculativeConfig(draft=draft, num_speculative_tokens=k, speculative_tree=tree))

    def run(chunk: int | None):
        sched = Scheduler(
            model.params, sc, slots=2, width=pages_needed(MAX_LEN, 0, sc), eos_token_ids=(),
            cache_dtype=jnp.float32, prefix_caching=True, chunked_prefill=chunk,
        )  # fmt: skip
        a = sched.submit(Request(running, 40, RowSampling.build(1), logprobs=1))
        sched.advance()
        sched.advance()
        b = sched.submit(Request(prompt, 8, RowSampling.build(1, temperature=0.7, seed=3), logprobs=1))
        before, iterations = len(a.tokens), 0
        while not b.tokens:
            sched.advance()
            iterations += 1
        sched._read_pending()
        during = len(a.tokens) - before
        caches = _prompt_rows(sched, b)
        while sched.advance():
            pass
        return a.tokens, b.tokens, caches, iterations, during, sched

    whole = run(None)
    chunked = run(16)
    assert chunked[0] == whole[0] and chunked[1] == whole[1]
    for got, want in zip(chunked[2], whole[2], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    sched = chunked[5]
    # the running request's 26 tokens: 1 chunk + 10; the long one's 88 - 16 cached: 4 chunks + 8
    assert sched.prefix.hits == page and sched.counts["prefill_chunks"] == 1 + 4
    assert whole[3] == 1 and chunked[3] == 5  # whole: at once; chunked: an iteration per chunk
    assert chunked[4] >= 4 and chunked[4] > whole[4]  # tokens of the running request meanwhile
    if tree is not None:  # not vacuous: the tree run accepted drafts
        assert sched.counters.num_accepted_tokens > 0
    assert sched.free_pages == sched.allocator.num_pages and not sched.filling


@pytest.fixture(scope="module")
def deepseek():
    return mtp_jax.load(EMBEDDED_MODEL, "float32")


@pytest.fixture(scope="module")
def mtp_engine(deepseek):
    """MTP K = 3 with thinking markers 5 and 6 (requests accept strictly unless they ask)."""
    with mtp_jax.Engine(
        deepseek, slots=2, max_len=MAX_LEN, draft="mtp", num_speculative_tokens=3, think_tokens=(5, 6)
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def llama():
    return mtp_jax.load(LLAMA, "float32")


def test_deepseek_and_mtp_share_prefixes(deepseek, mtp_engine):
    """MTP's row p pairs the target's state at p with token p + 1: it shares a page only when the
    next token agrees (lookahead 1); a thinking phase opened inside a cached prefix holds."""
    check_caches_after_a_hit(deepseek, "mtp", lookahead=1)
    check_reply_cached(deepseek, "mtp")
    check_chunked(deepseek, "mtp")
    check_chunked(deepseek, "mtp", {"depth": 3, "topk": 2, "nodes": 5, "dynamic": True})
    check_shared_prefixes(mtp_engine, lookahead=1)
    check_shared_prefixes(mtp_engine, lookahead=1, think=5)


@pytest.mark.parametrize(
    "draft, suffix, lookahead",
    [("eagle3", "eagle3", 1), ("dflash", "dflash", 0), ("draft_model", "draft", 0), ("ngram", None, 0)],
)
def test_llama_drafts_share_prefixes(llama, draft, suffix, lookahead):
    model = llama if suffix is None else llama.with_draft(f"{LLAMA}-{suffix}")
    check_caches_after_a_hit(model, draft, lookahead)
    check_reply_cached(model, draft)
    check_chunked(model, draft)
    with mtp_jax.Engine(model, slots=2, max_len=MAX_LEN, draft=draft, num_speculative_tokens=3) as engine:
        check_shared_prefixes(engine, lookahead)


def test_samples_of_one_prompt_admitted_together_prefill_it_once(deepseek):
    """Requests on one prompt submitted together (samples of a prompt, a shared system prompt): the
    first is prefilled, the others wait one iteration and read its pages (hits), with the tokens
    of the same requests without prefix caching."""
    page = deepseek.page_size
    rng = np.random.default_rng(8)
    prompt = [int(t) for t in rng.integers(7, 250, 2 * page + page // 2)]
    sc = step_config(deepseek, SpeculativeConfig(draft="mtp", num_speculative_tokens=3))
    out = []
    for prefix_caching in (True, False):
        sched = Scheduler(
            deepseek.params, sc, slots=2, width=pages_needed(MAX_LEN, 0, sc), eos_token_ids=(),
            cache_dtype=jnp.float32, prefix_caching=prefix_caching,
        )  # fmt: skip
        reqs = [
            sched.submit(Request(prompt, 6, RowSampling.build(1, temperature=0.8, seed=i))) for i in range(2)
        ]
        sched.advance()
        assert sched.counts["prefills"] == 1 and len(sched.queue) == (1 if prefix_caching else 0)
        while sched.advance():
            pass
        out.append([r.tokens for r in reqs])
        if prefix_caching:
            assert sched.prefix.hits == 2 * page and sched.counts["prefills"] == 2
    assert out[0] == out[1] and out[0][0] != out[0][1]  # equal runs; the seeds differ


def test_pressure_evicts_cached_pages_and_stays_exact(mtp_engine):
    """More distinct prompts than the pages hold: cached pages are evicted (least recently released
    first) instead of refusing anyone, outputs stay exact, the latest prefix is still there, and
    every page comes back."""
    engine = mtp_engine
    page = engine.model.page_size
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(7, 250, 3 * page + 2)] for _ in range(6)]
    pages = engine.stats()["num_pages"]
    assert 2 * 3 * len(prompts) > pages  # each prompt twice, 3 named pages each: more than fit
    for i, prompt in enumerate(prompts):
        assert _run(engine, prompt).tokens == _run(engine, prompt, cache_salt=f"pressed {i}").tokens
        assert engine.stats()["cached_pages"] <= pages
    before = _hits(engine)
    _run(engine, prompts[-1])
    assert _hits(engine) - before == 3 * page
    before = _hits(engine)
    _run(engine, prompts[0])  # long evicted
    assert _hits(engine) == before
    stats = engine.stats()
    assert stats["free_pages"] == stats["num_pages"]


def test_off_and_bad_salts(deepseek):
    with mtp_jax.Engine(deepseek, slots=2, max_len=64, prefix_caching=False) as engine:
        prompt = list(range(3, 40))
        assert _run(engine, prompt).tokens == _run(engine, prompt).tokens
        stats = engine.stats()
        assert stats["prefix_caching"] is False and "prefix_cache_hits" not in stats
        with pytest.raises(mtp_jax.InvalidRequestError, match="cache_salt"):
            engine.submit(prompt, max_new_tokens=4, cache_salt=3)


def test_warmup_compiles_the_chunk_and_only_buckets_up_to_it(deepseek):
    """With chunked prefill the warm-up compiles the chunk's program and prompt buckets up to the
    chunk (longer prompts arrive in chunks); a long prompt then compiles nothing new."""
    from mtp_jax.step import prefill, prefill_chunk

    sc = step_config(deepseek, SpeculativeConfig())
    sched = Scheduler(
        deepseek.params, sc, slots=2, width=pages_needed(MAX_LEN, 0, sc), eos_token_ids=(),
        cache_dtype=jnp.float32, chunked_prefill=32,
    )  # fmt: skip
    assert ("chunk", 1, 32) not in sched.warmup_jobs(32, [0])  # no prompt longer than a chunk
    jobs = sched.warmup_jobs(100, [0])
    assert ("chunk", 1, 32) in jobs and max(b for kind, _, b in jobs if kind == "prefill") == 32
    sched.warmup(100, [0])
    sizes = prefill._cache_size(), prefill_chunk._cache_size()
    rng = np.random.default_rng(5)
    req = sched.submit(Request([int(t) for t in rng.integers(7, 250, 100)], 4, RowSampling.build(1)))
    while sched.advance():
        pass
    assert len(req.tokens) == 4 and sched.counts["prefill_chunks"] == 3
    assert (prefill._cache_size(), prefill_chunk._cache_size()) == sizes


def test_a_request_cancelled_while_its_prompt_arrives_frees_everything(deepseek):
    sc = step_config(deepseek, SpeculativeConfig(draft="mtp", num_speculative_tokens=3))
    sched = Scheduler(
        deepseek.params, sc, slots=2, width=pages_needed(MAX_LEN, 0, sc), eos_token_ids=(),
        cache_dtype=jnp.float32, prefix_caching=True, chunked_prefill=16,
    )  # fmt: skip
    rng = np.random.default_rng(6)
    long = sched.submit(Request([int(t) for t in rng.integers(7, 250, 70)], 4, RowSampling.build(1)))
    sched.advance()
    assert sched.filling and sched.counts["prefill_chunks"] == 1
    sched.cancel(long)
    assert long.finish == "cancelled" and not sched.filling and not sched.busy
    assert sched.free_pages == sched.allocator.num_pages and sched.prefix.cached == 0  # nothing named
    short = sched.submit(Request([5, 6, 7], 4, RowSampling.build(1)))
    while sched.advance():
        pass
    assert len(short.tokens) == 4 and sched.free_pages == sched.allocator.num_pages
