"""Speculative decoding with the MTP draft: losslessness, continuous batching, one compilation,
streaming, statistics and refusals. Exactness of stochastic acceptance is in test_acceptance.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.sampling import RowSampling
from mtp_jax.scheduler import Request, Scheduler
from mtp_jax.step import StepConfig, init_state, step

RNG = np.random.default_rng(7)
LENGTHS = [5, 12, 3, 9, 17, 1]


def prompts_for(model, lengths=LENGTHS):
    return [RNG.integers(2, model.config.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def plain_greedy(oracle_model):
    prompts = prompts_for(oracle_model)
    return prompts, oracle_model.generate(prompts, max_new_tokens=23, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_speculative_equals_plain_greedy(oracle_model, plain_greedy, k):
    """Mixed prompt lengths in one batch, page size 4 (drafts cross page boundaries)."""
    prompts, plain = plain_greedy
    spec = oracle_model.generate(
        prompts, max_new_tokens=23, ignore_eos=True, draft="mtp", num_speculative_tokens=k
    )
    assert spec.tokens == plain.tokens
    st = spec.stats
    # the oracle draft is accepted often but not always: every acceptance length is exercised
    assert 1.3 < st["acceptance_length"] < k + 1 - 0.1
    rates = st["acceptance_rate_per_position"]
    assert len(rates) == k and all(0.0 < r < 1.0 for r in rates)
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert st["steps"] < plain.stats["steps"]


def test_continuous_batching_is_lossless(oracle_model):
    """More prompts than slots: requests join as others finish (EOS and max-token stops mixed)."""
    prompts = prompts_for(oracle_model, [5, 12, 3, 9, 17, 1, 4, 8, 2])
    plain = oracle_model.generate(prompts, max_new_tokens=15)
    spec = oracle_model.generate(
        prompts, max_new_tokens=15, draft="mtp", num_speculative_tokens=3, max_batch=2
    )
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
    assert spec.stats["batch"] == 2 and spec.stats["prefill_calls"] >= 4
    assert spec.stats["acceptance_length"] > 1.5, spec.stats  # not vacuous: drafts were accepted


def test_stops_drop_tokens_past_eos(oracle_model):
    prompt = prompts_for(oracle_model, [6])
    free = oracle_model.generate(prompt, max_new_tokens=20, ignore_eos=True).tokens[0]
    eos = free[7]
    m = mtp_jax.Model(
        oracle_model.config, oracle_model.params, dtype="float32", eos_token_ids=[eos], page_size=4
    )
    spec = m.generate(prompt, max_new_tokens=20, draft="mtp", num_speculative_tokens=5)
    assert spec.tokens[0] == free[: free.index(eos) + 1] and spec.finish_reasons == ["eos"]


def test_streaming_callback_sees_every_token_in_order(oracle_model):
    prompts = prompts_for(oracle_model, [3, 7])
    seen: dict[int, list[int]] = {0: [], 1: []}
    result = oracle_model.generate(
        prompts,
        max_new_tokens=11,
        ignore_eos=True,
        draft="mtp",
        num_speculative_tokens=3,
        on_token=lambda i, t: seen[i].append(t),
    )
    assert [seen[0], seen[1]] == result.tokens


def test_speculative_step_compiles_once(oracle_model):
    prompts = prompts_for(oracle_model, [4, 6])
    oracle_model.generate(prompts, max_new_tokens=12, draft="mtp", num_speculative_tokens=2, ignore_eos=True)
    seen = step._cache_size()
    result = oracle_model.generate(
        prompts, max_new_tokens=14, draft="mtp", num_speculative_tokens=2, ignore_eos=True
    )
    assert result.stats["steps"] > 3
    assert step._cache_size() == seen


def test_an_all_greedy_call_traces_no_sampling_and_keeps_every_token(oracle_model):
    """When every row is greedy, generate runs greedy-only programs (``StepConfig.greedy``): no
    draw, sort, truncation or greedy/sampled ``cond`` is traced into the step, and the tokens are
    those the same rows get from the general program, in a batch where another row samples."""
    prompts = prompts_for(oracle_model, [5, 12, 3])
    kw = dict(max_new_tokens=10, ignore_eos=True, draft="mtp", num_speculative_tokens=2)
    kw["draft_sampling"] = "sampled"
    greedy = oracle_model.generate(prompts, **kw)
    mixed = oracle_model.generate(prompts + prompts[:1], temperature=[0.0, 0.0, 0.0, 1.0], seed=3, **kw)
    assert mixed.tokens[:3] == greedy.tokens
    assert greedy.stats["acceptance_length"] > 1.3  # not vacuous: the sampled-mode drafts were accepted

    general = StepConfig(oracle_model.config, 4, k=2, draft="mtp", draft_sampling="sampled")
    state = init_state(general, 2, 8, 4, jnp.float32)

    def primitives(jaxpr, found: set) -> set:
        for eqn in jaxpr.eqns:
            found.add(eqn.primitive.name)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        primitives(getattr(sub, "jaxpr", sub), found)
        return found

    def traced(sc: StepConfig) -> set:
        return primitives(step.trace(oracle_model.params, state, sc).jaxpr.jaxpr, set())

    everything, argmax_only = traced(general), traced(dataclasses.replace(general, greedy=True))
    for primitive in ("random_bits", "cumsum", "cond"):  # draws, nucleus masses, greedy/sampled
        assert primitive in everything and primitive not in argmax_only, primitive
    assert "sort" not in argmax_only  # (top_k is the MoE router's, in both)

    sched = Scheduler(
        oracle_model.params, dataclasses.replace(general, greedy=True), slots=2, width=4,
        eos_token_ids=(), cache_dtype=jnp.float32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="greedy-only"):
        sched.submit(Request(prompts[0], 3, RowSampling.build(1, temperature=0.7)))


def test_bfloat16_speculative_matches_its_plain_decoding(make_checkpoint):
    from tests.conftest import TINY_CONFIG, oracle_tensors

    path = make_checkpoint(tensors=oracle_tensors(TINY_CONFIG, alpha=0.6))
    model = mtp_jax.load(path, dtype="bfloat16", page_size=4)
    prompts = [[5, 9, 13, 2], [40, 41]]
    plain = model.generate(prompts, max_new_tokens=10, ignore_eos=True)
    spec = model.generate(prompts, max_new_tokens=10, ignore_eos=True, draft="mtp", num_speculative_tokens=2)
    assert spec.tokens == plain.tokens
    assert spec.stats["acceptance_length"] > 1.5, spec.stats  # not vacuous: drafts were accepted


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"draft": "eagle"}, "unknown draft 'eagle'"),
        ({"draft": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"draft": "mtp", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "needs a draft"),
        ({"draft": "mtp", "draft_sampling": "greedy"}, "draft_sampling"),
        ({"max_batch": 0}, "max_batch"),
    ],
)
def test_bad_speculative_arguments(oracle_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        oracle_model.generate([[3, 4]], max_new_tokens=2, **kwargs)


def test_mtp_draft_needs_an_mtp_layer(make_checkpoint, tiny_config):
    tiny_config["num_nextn_predict_layers"] = 0
    model = mtp_jax.load(make_checkpoint(tiny_config), "float32")
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP layer"):
        model.generate([[3, 4]], max_new_tokens=2, draft="mtp")
    assert jnp.asarray(model.generate([[3, 4]], max_new_tokens=2).tokens).size >= 1


def test_host_orchestrated_baseline_gives_the_same_tokens(oracle_model):
    prompts = prompts_for(oracle_model, [5, 12, 3])
    fused = oracle_model.generate(
        prompts, max_new_tokens=12, ignore_eos=True, draft="mtp", num_speculative_tokens=3
    )
    host = oracle_model.generate(
        prompts, max_new_tokens=12, ignore_eos=True, draft="mtp", num_speculative_tokens=3, fused=False
    )
    assert host.tokens == fused.tokens and host.stats["fused"] is False
    assert host.stats["acceptance_length"] == fused.stats["acceptance_length"]
