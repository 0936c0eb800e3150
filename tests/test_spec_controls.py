"""Per-request speculation controls in the unified step: each request's own K (0 = plain), the
automatic K table, relaxed acceptance inside thinking phases, and the speculation counters.
The acceptance rules themselves (caps, the relaxed rule) are checked exactly in test_acceptance.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtp_jax import autok
from mtp_jax.step import step

RNG = np.random.default_rng(19)
LENGTHS = [5, 12, 3, 9, 17, 1]
KS = [0, 1, 3, 2, 3, 0]


@pytest.fixture(scope="module")
def prompts(oracle_model):
    return [RNG.integers(2, oracle_model.config.vocab_size, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def plain(oracle_model, prompts):
    return oracle_model.generate(prompts, max_new_tokens=19, ignore_eos=True)


def test_each_request_speculates_at_most_its_own_k(oracle_model, prompts, plain):
    out = oracle_model.generate(
        prompts, max_new_tokens=19, ignore_eos=True, draft="mtp", num_speculative_tokens=KS
    )
    assert out.tokens == plain.tokens
    assert out.stats["num_speculative_tokens"] == 3
    for k, st in zip(KS, out.request_stats, strict=True):
        per_pos = st["num_accepted_tokens_per_pos"]
        assert len(per_pos) == 3 and not any(per_pos[k:]), (k, per_pos)
        assert st["num_draft_tokens"] == k * st["steps"]  # every step of the row verified its K
        if k == 0:
            assert st["acceptance_length"] == 1.0 and st["num_drafts"] == 0
        else:
            assert st["num_accepted_tokens"] > 0
            assert st["acceptance_length"] == pytest.approx(1 + st["num_accepted_tokens"] / st["steps"])
    # the run's counters are the requests' summed
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert out.stats[key] == sum(st[key] for st in out.request_stats)
    assert (
        out.stats["num_accepted_tokens_per_pos"]
        == np.sum([st["num_accepted_tokens_per_pos"] for st in out.request_stats], axis=0).tolist()
    )


def test_a_k0_request_is_plain_sampling_bit_for_bit(oracle_model, prompts):
    """Sampled rows, argmax drafts: every row draws each position as plain decoding would, so with
    or without speculating neighbours a K = 0 request's tokens are plain sampling's."""
    kw = dict(max_new_tokens=15, ignore_eos=True, temperature=0.9, top_p=0.95, seed=list(range(6)))
    alone = oracle_model.generate(prompts, **kw)
    spec = oracle_model.generate(prompts, draft="mtp", num_speculative_tokens=KS, **kw)
    assert spec.tokens == alone.tokens
    # sampled drafts: the K = 0 rows never draw from a draft, so they are plain sampling too
    sampled = oracle_model.generate(
        prompts, draft="mtp", num_speculative_tokens=KS, draft_sampling="sampled", **kw
    )
    for i, k in enumerate(KS):
        if k == 0:
            assert sampled.tokens[i] == alone.tokens[i]


def test_the_step_follows_the_running_requests(oracle_model, prompts, plain):
    """Two slots, requests queued: the step verifies as many drafts as the running requests ask for
    (one program per count, plain once only K = 0 requests run); the output stays plain's."""
    order = [4, 0, 5, 1, 2, 3]  # K 3, 0, 0, 1, 3, 2
    before = step._cache_size()
    out = oracle_model.generate(
        [prompts[i] for i in order],
        max_new_tokens=19,
        ignore_eos=True,
        draft="mtp",
        num_speculative_tokens=[KS[i] for i in order],
        max_batch=2,
    )
    assert out.tokens == [plain.tokens[i] for i in order]
    assert out.stats["step_num_speculative_tokens"] == sorted(set(out.stats["step_num_speculative_tokens"]))
    assert {0, 3} <= set(out.stats["step_num_speculative_tokens"])
    assert step._cache_size() - before <= out.stats["step_programs"]


def test_only_zero_k_requests_decode_plainly(oracle_model, prompts, plain):
    out = oracle_model.generate(
        prompts, max_new_tokens=19, ignore_eos=True, draft="mtp", num_speculative_tokens=[0] * 6
    )
    assert out.tokens == plain.tokens and out.stats["draft"] is None and out.stats["num_draft_tokens"] == 0


def test_auto_k_from_a_measured_table(oracle_model, prompts, plain, tmp_path):
    """The table caps K by batch size: a batch of 8 slots where speculation did not pay decodes
    plainly; one slot speculates with the table's K."""
    path = str(tmp_path / "auto.json")
    autok.write(path, {"mtp": {1: 2, 4: 1, 8: 0}, "eagle3": {1: 1}}, {"model": "oracle"})
    kw = dict(max_new_tokens=19, ignore_eos=True, draft="mtp", num_speculative_tokens=3, auto_k=path)
    busy = oracle_model.generate(prompts, max_batch=8, **kw)
    assert busy.tokens == plain.tokens and busy.stats["batch"] == 8
    assert busy.stats["draft"] is None and busy.stats["step_programs"] == 1
    one = oracle_model.generate(prompts[:1], max_batch=1, **kw)
    assert one.tokens == plain.tokens[:1] and one.stats["num_speculative_tokens"] == 2
    four = oracle_model.generate(prompts[:4], max_batch=4, **{**kw, "auto_k": {1: 2, 4: 1}})
    assert four.tokens == plain.tokens[:4] and four.stats["num_speculative_tokens"] == 1
    table = autok.AutoK.load(path, "mtp")
    assert [table(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [2, 2, 2, 1, 1, 0, 0]


def test_auto_k_best_k_reads_bench_rows():
    rows = [
        {"batch": 1, "draft": None, "k": 0, "decode_tok_s": 100.0},
        {"batch": 1, "draft": "mtp", "k": 1, "decode_tok_s": 130.0},
        {"batch": 1, "draft": "mtp", "k": 3, "decode_tok_s": 150.0},
        {"batch": 1, "draft": "dflash", "k": 3, "decode_tok_s": 90.0},
        {"batch": 1, "draft": "dflash", "k": 3, "block_size": 4, "decode_tok_s": 190.0},
        {"batch": 8, "draft": None, "k": 0, "decode_tok_s": 400.0},
        {"batch": 8, "draft": "mtp", "k": 1, "decode_tok_s": 380.0},
        {"batch": 8, "draft": "dflash", "k": 3, "decode_tok_s": 420.0},
        # mtp-jax bench's DFlash rows name their block: at the trained one they count
        {
            "batch": 8,
            "draft": "dflash",
            "k": 5,
            "block_size": 8,
            "trained_block_size": 8,
            "decode_tok_s": 450.0,
        },
        {
            "batch": 8,
            "draft": "dflash",
            "k": 1,
            "block_size": 2,
            "trained_block_size": 8,
            "decode_tok_s": 999.0,
        },
    ]
    assert autok.best_k(rows) == {"mtp": {1: 3, 8: 0}, "dflash": {1: 0, 8: 5}}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "does not exist"),
        ("{", "not JSON"),
        (json.dumps({"format": "other", "k_by_batch": {"1": 2}}), "not an auto-K table"),
        (json.dumps({"format": autok.FORMAT, "k_by_batch": {"mtp": {"one": 2}}}), "must be integers"),
        (json.dumps({"format": autok.FORMAT, "k_by_batch": {"mtp": {"1": -2}}}), "bad K -2"),
        (json.dumps({"format": autok.FORMAT, "k_by_batch": {"mtp": {}}}), "empty"),
        (json.dumps({"format": autok.FORMAT, "k_by_batch": {"eagle3": {"1": 2}}}), "'eagle3', not 'mtp'"),
    ],
)
def test_bad_auto_k_tables_are_named(oracle_model, tmp_path, content, match):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        oracle_model.generate([[3, 4]], max_new_tokens=2, draft="mtp", auto_k=str(path))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"draft": "mtp", "num_speculative_tokens": [1, 17]},
            r"num_speculative_tokens must be in \[0, 16\], got 17 \(row 1\)",
        ),
        ({"draft": "mtp", "num_speculative_tokens": [1]}, "1 values for 2 prompts"),
        ({"num_speculative_tokens": [1, 0]}, "needs a draft"),
        ({"draft": "mtp", "relaxed_topk": -1}, "relaxed_topk"),
        ({"draft": "mtp", "relaxed_topk": 2, "relaxed_delta": 1.5}, "relaxed_delta"),
        ({"relaxed_topk": 2, "think_tokens": (5, 6)}, "needs a draft"),
        ({"draft": "mtp", "relaxed_topk": 2}, "no <think> and </think> tokens"),
        ({"draft": "mtp", "relaxed_topk": 2, "think_tokens": (5, 5)}, "two different ids"),
        ({"draft": "mtp", "relaxed_topk": 2, "think_tokens": (5, 10**6)}, "outside"),
        ({"draft": "mtp", "auto_k": 3}, "auto_k must be"),
        ({"auto_k": {1: 2}}, "auto_k chooses how many drafts"),
    ],
)
def test_bad_controls_are_named(oracle_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        oracle_model.generate([[3, 4], [5]], max_new_tokens=2, **kwargs)


def test_relaxed_acceptance_only_inside_thinking_and_only_when_asked(oracle_model, prompts, plain):
    """Think markers (two ordinary ids here): rows whose prompt leaves them thinking accept more
    with relaxed_topk; rows outside a phase, and rows that do not ask, are exactly strict."""
    start, end = 7, 8
    thinking = [p + [start] for p in prompts[:3]]
    closed = [p + [start, 11, end] for p in prompts[3:]]
    batch = thinking + closed
    kw = dict(max_new_tokens=19, ignore_eos=True, draft="mtp", num_speculative_tokens=3)
    strict = oracle_model.generate(batch, **kw)
    relaxed = oracle_model.generate(
        batch, relaxed_topk=[4, 0, 4, 4, 4, 4], relaxed_delta=0.5, think_tokens=(start, end), **kw
    )
    for i in (1, 3, 4, 5):  # not asked; asked but outside a thinking phase (unless one reopens)
        if i == 1 or start not in strict.tokens[i]:
            assert relaxed.tokens[i] == strict.tokens[i], i
    gained = [
        relaxed.request_stats[i]["acceptance_length"] - strict.request_stats[i]["acceptance_length"]
        for i in (0, 2)
    ]
    assert max(gained) > 0, gained
    assert relaxed.tokens[0] != strict.tokens[0] or relaxed.tokens[2] != strict.tokens[2]
