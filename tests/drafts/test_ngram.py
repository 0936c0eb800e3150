"""The n-gram prompt-lookup draft (mtp_jax/drafts/ngram/draft.py): its lookup against a plain-Python
reference and by hand; greedy speculation lossless on both targets with drafts accepted; a sampled
row's output independent of its batch; teacher-forced logits; weightless (any model, never picked
by auto); the CLI. Its exactness under sampling is in tests/test_acceptance.py."""

from __future__ import annotations

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.drafts.ngram.draft import MAX_N, MIN_N, lookup
from tests.conftest import EMBEDDED_MODEL, REPO, check_per_request_k, cli_run

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")


def reference(history: list[int], k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> list[int]:
    """The rule in plain Python: the longest suffix (max_n..min_n tokens) with an earlier
    occurrence, its latest occurrence, the tokens after it (periodic past the present); else the
    newest token again."""
    found = match(history, max_n, min_n)
    if found is None:
        return [history[-1]] * k
    period = len(history) - 1 - found[1]
    return [history[found[1] + 1 + j % period] for j in range(k)]


def match(history: list[int], max_n: int = MAX_N, min_n: int = MIN_N) -> tuple[int, int] | None:
    """(length, end) of the longest suffix of max_n..min_n tokens with an earlier occurrence, and
    where its latest occurrence ends; None when none has."""
    n = len(history)
    for m in range(min(max_n, n), min_n - 1, -1):
        suffix = history[n - m :]
        for end in range(n - 2, m - 2, -1):  # latest first
            if history[end - m + 1 : end + 1] == suffix:
                return m, end
    return None


_lookup = jax.jit(lookup, static_argnames=("k", "max_n", "min_n", "none"))  # as the step runs it


def run_lookup(histories: list[list[int]], k: int, width: int = 48, **kw) -> list[list[int]]:
    rng = np.random.default_rng(len(histories))
    padded = rng.integers(0, 50, (len(histories), width)).astype(np.int32)  # garbage past each row's end
    for i, h in enumerate(histories):
        padded[i, : len(h)] = h
    n = jnp.asarray([len(h) for h in histories], jnp.int32)
    return np.asarray(_lookup(jnp.asarray(padded), n, k, **kw)).tolist()


def test_lookup_by_hand():
    cases = [
        ([1, 2, 3, 1, 2], 3, [3, 1, 2]),  # suffix 1 2 seen at 0..1; its followers, then periodic
        ([5, 5, 5], 3, [5, 5, 5]),  # period 1
        ([1, 2, 3], 2, [3, 3]),  # no match: the newest token again
        ([7, 1, 2, 9, 1, 2, 4, 1, 2], 4, [4, 1, 2, 4]),  # the latest occurrence of 1 2 (ends at 5)
        ([4], 2, [4, 4]),  # a one-token history
        ([3, 8, 6, 3], 2, [8, 6]),  # only a one-token suffix matches
    ]
    got = run_lookup([h for h, _, _ in cases], 4, min_n=1)
    for (h, k, want), row in zip(cases, got, strict=True):
        assert row[:k] == want, h
    # by default a suffix of fewer than MIN_N (3) tokens proposes nothing: only the three-token one
    short = [[1, 2, 3, 1, 2], [3, 8, 6, 3], [9, 1, 2, 3, 7, 1, 2, 3]]
    assert MIN_N == 3 and run_lookup(short, 2) == [[2, 2], [3, 3], [7, 1]]
    assert run_lookup(short, 2, none=-1) == [[-1, -1], [-1, -1], [7, 1]]
    # the longest suffix wins over a later, shorter match; MAX_N bounds it
    h = [1, 2, 3, 4, 5, 9, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5]
    assert run_lookup([h], 1, max_n=5) == [[9]] and reference(h, 1, max_n=5) == [9]
    assert run_lookup([h], 1) == [[8]] and MAX_N == 4


@pytest.mark.parametrize("k", [1, 3, 6])
def test_lookup_equals_the_reference_on_random_histories(k):
    rng = np.random.default_rng(k)
    histories = [
        rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 41))).tolist() for _ in range(400)
    ]
    got = run_lookup(histories, k)
    assert got == [reference(h, k) for h in histories]
    # not vacuous at the lookup's own MIN_N: many rows matched a suffix, some of MAX_N tokens
    lengths = [found[0] for found in map(match, histories) if found is not None]
    assert len(lengths) > 100 and lengths.count(MAX_N) > 10


@pytest.fixture(scope="module")
def models():
    return {
        "llama": mtp_jax.load(LLAMA, "float32", page_size=4),
        "deepseek": mtp_jax.load(EMBEDDED_MODEL, "float32", page_size=4),
    }


PROMPTS = [
    [5, 9, 17, 3, 5, 9, 17, 3, 5, 9],
    [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5],
    [100],
    [8, 8, 8, 8, 8, 8, 8],
]


@pytest.mark.parametrize("which", ["llama", "deepseek"])
def test_greedy_speculation_is_lossless_and_accepts_drafts(models, which):
    model = models[which]
    assert "ngram" not in model.drafts  # weightless: asked for by name, never picked by auto
    plain = model.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
    for k in (1, 4):
        out = model.generate(
            PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3, draft="ngram", num_speculative_tokens=k
        )
        assert out.tokens == plain.tokens, k
        # the tiny models repeat themselves: several drafts accepted (5 and 8 on DeepSeek-V3, 15 and
        # 24 on Llama at K = 1 and 4 when written)
        assert out.stats["num_accepted_tokens"] >= 5 and out.stats["acceptance_length"] > 1.05, out.stats
    check_per_request_k(model, "ngram", PROMPTS, plain.tokens)


@pytest.mark.parametrize("draft_sampling", ["argmax", "sampled"])
def test_a_sampled_row_does_not_depend_on_its_batch(models, draft_sampling):
    model = models["llama"]
    kw = dict(max_new_tokens=12, ignore_eos=True, draft="ngram", num_speculative_tokens=3)
    kw["draft_sampling"] = draft_sampling
    mine = dict(temperature=0.7, top_k=20, seed=5)
    alone = model.generate([PROMPTS[0]], **mine, **kw).tokens[0]
    batch = model.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[3]],
        temperature=[1.0, 0.7, 0.0],
        top_k=[0, 20, 0],
        seed=[1, 5, 2],
        **kw,
    ).tokens
    assert batch[1] == alone


def test_teacher_forced_logits_are_the_lookup(models):
    model = models["deepseek"]
    seqs = [[5, 9, 17, 3, 5, 9, 17, 3], [1, 2, 3, 4, 5, 6, 7, 1]]
    logits = model.draft_logits(seqs, draft="ngram")
    assert logits.shape == (2, 7, model.config.vocab_size) and logits.dtype == np.float32
    for b, seq in enumerate(seqs):
        for i in range(7):
            want = reference(seq[: i + 2], 1)[0]
            assert np.argmax(logits[b, i]) == want and np.isfinite(logits[b, i]).sum() == 1


@pytest.mark.spawns
def test_the_cli_takes_any_registered_draft_and_refuses_others(capsys):
    base = ["generate", "--model", LLAMA, "--prompt", "def f(x):\n    return x\n\n\ndef f(x):"]
    code, err = cli_run(capsys, *base, "--draft", "ngram", "-k", "3", "--max-new-tokens", "8")
    assert code == 0 and "acceptance" in err, err
    code, err = cli_run(capsys, *base, "--draft", "lookahead")
    assert code != 0 and "'lookahead' is not a draft method" in err and "ngram" in err


SHARDED_CHILD = textwrap.dedent(
    """
    import os, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    assert len(jax.devices()) == 8
    import mtp_jax
    from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from tests.conftest import TINY_CONFIG
    from tests.drafts.test_eagle3 import TARGET

    ds_target = os.path.join(tempfile.mkdtemp(), "ds")
    write_hub_checkpoint(ds_target, TINY_CONFIG, hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG), seed=0))
    prompts = [[5, 9, 17, 3, 5, 9], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77], [10], [8, 8, 8, 8, 8, 8], [3, 1]]
    spec = dict(max_new_tokens=10, ignore_eos=True, draft="ngram", num_speculative_tokens=3)
    sampled = dict(spec, temperature=0.9, top_k=20, seed=[1, 2, 3, 4, 5])
    for target, meshes in [
        (TARGET, [dict(data=4, tensor=2)]),
        (ds_target, [dict(data=2, expert=4)]),
    ]:
        one = mtp_jax.load(target, "float32", page_size=4)
        want = {how: one.generate(prompts, draft_sampling=how, **kw).tokens
                for how, kw in (("argmax", spec), ("sampled", sampled))}
        for axes in meshes:
            model = mtp_jax.load(target, "float32", page_size=4, mesh=mtp_jax.make_mesh(**axes))
            for how, kw in (("argmax", spec), ("sampled", sampled)):
                out = model.generate(prompts, draft_sampling=how, **kw)
                assert out.tokens == want[how], (target, axes, how)
                if how == "argmax":  # (sampled random-weight text rarely repeats itself)
                    assert out.stats["acceptance_length"] > 1.0, (target, axes, how)
    print("NGRAM-SHARDED-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(SHARDED_CHILD)
def test_sharded_like_one_device(child_output):
    assert "NGRAM-SHARDED-OK" in child_output


def test_the_engine_serves_with_it(models):
    model = models["llama"]
    plain = model.generate(PROMPTS, max_new_tokens=12, ignore_eos=True).tokens
    with mtp_jax.Engine(model, slots=2, max_len=64, draft="ngram", num_speculative_tokens=3) as engine:
        handles = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in PROMPTS]
        assert [list(h.result(timeout=120).tokens) for h in handles] == plain
        assert engine.stats()["acceptance_length"] > 1.0


def test_the_roofline_counts_its_token_buffer_and_bench_step_times_it(models):
    from mtp_jax.roofline import build_parser, run, step_bytes

    model = models["llama"]
    kw = dict(batch=2, context=9, cache_itemsize=4)
    plain = step_bytes(model.params, model.config, k=0, **kw)
    got = step_bytes(model.params, model.config, k=3, draft="ngram", **kw)
    positions = 2 * (9 + 3 + 1)
    assert got.draft_weights == got.draft_heads == got.draft_experts == 0
    assert got.kv == pytest.approx(plain.kv / (2 * 10) * positions + positions * 4)
    args = [
        "--model",
        LLAMA,
        "--draft",
        "ngram",
        "--k",
        "0",
        "2",
        "--iters",
        "2",
        "--copy-mb",
        "4",
        "--context",
        "8",
    ]
    out = run(build_parser().parse_args(args))
    assert [r["draft"] for r in out["results"]] == [None, "ngram"] and all(
        r["step_ms"] > 0 for r in out["results"]
    )
    # beside the step whose lookup matched, the one in which no row has a draft (time_step(drafts=0))
    assert out["results"][1]["no_match_step_ms"] > 0 and "no_match_step_ms" not in out["results"][0]
    with pytest.raises(ValueError, match="--draft eagle3 needs its weights"):
        run(build_parser().parse_args(["--model", LLAMA, "--draft", "eagle3", "--k", "1"]))


def test_unproposed_drafts_cap_their_row_and_become_valid_ids():
    """A draft with ``proposes_per_row`` marks missing proposals -1: the row's count stops at its
    first one (capped by the request's K as before) and the stored ids stay valid tokens."""
    from mtp_jax.step import StepConfig, _proposed

    sc = StepConfig(mtp_jax.load(LLAMA, "float32").config, 4, 3, "ngram")
    drafts = jnp.asarray([[5, 6, 7], [-1, -1, -1], [5, -1, 7], [1, 2, 3]], jnp.int32)
    cap = jnp.asarray([3, 3, 3, 2], jnp.int32)
    fixed, count = _proposed(sc, drafts, cap, jnp.asarray([9, 9, 9, 9], jnp.int32))
    assert np.asarray(count).tolist() == [3, 0, 1, 2]
    assert np.asarray(fixed).tolist() == [[5, 6, 7], [9, 9, 9], [5, 9, 7], [1, 2, 3]]
    lookup_none = lookup(jnp.asarray([[1, 2, 3, 0]]), jnp.asarray([3]), 2, none=-1)
    assert np.asarray(lookup_none).tolist() == [[-1, -1]]  # no earlier occurrence of 3


def test_a_step_without_matches_verifies_one_token_per_row(models):
    """With no row matching, the step runs its plain branch: the same tokens as plain decoding, and
    prompts of distinct tokens generate as plain decoding does while the drafts run dry."""
    model = models["llama"]
    prompts = [[11, 12, 13, 14], [21, 22, 23]]
    plain = model.generate(prompts, max_new_tokens=6, ignore_eos=True)
    spec = model.generate(prompts, max_new_tokens=6, ignore_eos=True, draft="ngram", num_speculative_tokens=3)
    assert spec.tokens == plain.tokens
    # the plain branch ran: the step takes it when no active row's lookup matched, and no history a
    # step looked up (each prompt and the tokens before each step) has a match (the reference's
    # rule); each step then emitted one token a row
    histories = [p + t[:i] for p, t in zip(prompts, spec.tokens, strict=True) for i in range(len(t))]
    assert all(match(h) is None for h in histories)
    assert spec.stats["acceptance_length"] == 1 and spec.stats["num_accepted_tokens"] == 0


def replay_counts(prompt: list[int], reply: list[int], k: int, new_tokens: int) -> tuple[int, int, int, int]:
    """(steps, steps that verified drafts, drafts verified, drafts accepted) of greedy n-gram
    speculation walked on the host: the first token from the prefill; each step proposes the
    reference's K drafts when the history has a match (none otherwise), accepts those equal to
    the greedy ``reply`` (longer than ``new_tokens`` so the last step can be judged) and emits one
    more, until ``new_tokens`` are out."""
    out, steps, drafting, drafted, accepted = 1, 0, 0, 0, 0
    while out < new_tokens:
        history = prompt + reply[:out]
        drafts = [] if match(history) is None else reference(history, k)
        a = 0
        while a < len(drafts) and drafts[a] == reply[out + a]:
            a += 1
        steps, drafting = steps + 1, drafting + bool(drafts)
        drafted, accepted = drafted + len(drafts), accepted + a
        out += a + 1
    return steps, drafting, drafted, accepted


def test_the_drafts_counted_are_the_rows_own():
    """num_draft_tokens counts the drafts each row held, not K per step: a step whose row had no
    match verified none. Checked against a walk of the greedy replies on the host, on prompts
    where some steps match and some do not (K per drafting step would count more)."""
    model = mtp_jax.load(LLAMA, "float32", page_size=4)
    prompts = [[5, 9, 17, 3, 5, 9, 17, 3, 5, 9], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [11, 12, 13, 14]]
    k, n = 4, 24
    replies = model.generate(prompts, max_new_tokens=n + k + 1, ignore_eos=True).tokens
    want = np.zeros(4, int)
    for prompt, reply in zip(prompts, replies, strict=True):
        want += replay_counts(prompt, reply, k, n)
    out = model.generate(prompts, max_new_tokens=n, ignore_eos=True, draft="ngram", num_speculative_tokens=k)
    st = out.stats
    assert out.tokens == [r[:n] for r in replies]
    got = [st["num_drafts"], st["num_draft_tokens"], st["num_accepted_tokens"]]
    assert got == want[1:].tolist(), (got, want)
    assert 0 < want[1] < want[0] and want[2] < k * want[0]  # some rows' steps without a match


@pytest.mark.parametrize("which", ["llama", "deepseek"])
def test_the_step_updates_the_caches_in_place(models, which):
    """Choosing between the step that verifies K + 1 tokens and the one that verifies one must not
    copy the KV page pools: XLA copies a buffer that a ``lax.cond`` branch updates in place (twice
    a step, 7% of SmolLM2's step on a CPU, the whole pool on a GPU); ``step.either``'s loops don't."""
    from mtp_jax.step import StepConfig, init_state, step

    model = models[which]
    sc = StepConfig(model.config, 4, 3, "ngram")
    state = init_state(sc, 2, 16, 8, jnp.float32)
    hlo = step.lower(model.params, state, sc).compile().as_text()
    pools = {
        f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state.target_pages) if x.ndim >= 3
    }
    assert pools
    copied = [
        line.strip()[:160] for line in hlo.splitlines() if " copy(" in line and any(p in line for p in pools)
    ]
    assert not copied, copied
