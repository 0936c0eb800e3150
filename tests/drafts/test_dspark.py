"""DSpark drafts: DeepSpec's checkpoint layout read and written, the draft's logits and confidences
against an independent float64 implementation of the paper's equations (on transformers' own
hidden states), the decode-time block over the paged context, speculative generation on both
target families, and the errors a bad draft gets. The sampled law through ``generate`` is checked
in tests/test_acceptance.py."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.drafts.dspark.config import DSparkConfig
from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors
from mtp_jax.errors import CheckpointError, ConfigError, InvalidRequestError
from tests.conftest import check_per_request_k
from tests.drafts.test_dflash import DRAFT_A as DFLASH_A
from tests.drafts.test_dflash import prompt_rows, reference_block_states
from tests.drafts.test_eagle3 import DEEPSEEK_TARGET, REF, TARGET  # the Llama target: L = 3, d = 32, V = 128

# DeepSpec's config: the target's text config plus the DSpark fields. DFlash's draft "a" (two
# layers, GQA 4/2, a block of 4) with its own plain rope, the embedding output (-1) and layer 1
# captured, a vanilla Markov head of rank 8 and a confidence head that reads it.
DSPARK_A = {
    **{k: v for k, v in DFLASH_A.items() if k not in ("dflash_config", "rope_scaling")},
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "num_target_layers": 3,
    "target_layer_ids": [-1, 1],
    "mask_token_id": 127,
    "num_anchors": 512,
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "tie_word_embeddings": False,
    "layer_types": ["full_attention", "full_attention"],
}
# the RNN head (rank 6), one layer, a block of 3, calibrated confidences
DSPARK_R = {
    **DSPARK_A,
    "num_hidden_layers": 1,
    "layer_types": ["full_attention"],
    "block_size": 3,
    "target_layer_ids": [0],
    "markov_rank": 6,
    "markov_head_type": "rnn",
    "confidence_temperatures": [1.5, 0.8, 2.0],
    "confidence_shifts": [0.3, -0.7, 0.0],
}
# the gated head, its confidence head without the Markov feature
DSPARK_G = {**DSPARK_A, "markov_head_type": "gated", "confidence_head_with_markov": False}
# DeepSpec's DFlash: the same class without heads (markov_rank 0, no confidence head)
DSPARK_0 = {
    **{k: v for k, v in DSPARK_A.items() if k not in ("markov_head_type", "confidence_head_with_markov")},
    "markov_rank": 0,
    "enable_confidence_head": False,
}
# "a" with a draft vocabulary (mtp-jax's extension): 96 of the 128 target ids, W2 over them
DSPARK_V = {**DSPARK_A, "draft_vocab_size": 96}
VOCAB_IDS = np.sort(np.random.default_rng(5).choice(128, 96, replace=False)).astype(np.int32)
CONFIGS = {"a": DSPARK_A, "r": DSPARK_R, "g": DSPARK_G, "0": DSPARK_0, "v": DSPARK_V}


def _target_arrays(model) -> tuple[np.ndarray, np.ndarray]:
    """(embedding [V, d], head [V, d]) of a loaded target (checked against transformers in
    tests/targets)."""
    embed = np.asarray(model.params["embed"])
    head = np.asarray(model.params["lm_head"]).T if "lm_head" in model.params else embed
    return embed, head


@pytest.fixture(scope="module")
def target():
    return mtp_jax.load(TARGET, "float32", strict=True)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory) -> dict:
    """name -> (draft directory, its tensors, its raw config)."""
    root = tmp_path_factory.mktemp("dspark")
    # small backbone weights: the block's outputs stay near the anchor's embedding, so the target's
    # head there agrees with the target's next token a fair share of the time (seed 3: 7-43% at
    # slot 0 on PROMPTS' greedy continuations), and greedy speculation accepts some drafts
    embed, head = _target_arrays(target)
    out = {}
    for name, raw in CONFIGS.items():
        ids = VOCAB_IDS if raw.get("draft_vocab_size") else None
        tensors = dspark_hub_tensors(
            DSparkConfig.from_dict(raw), embed, head, seed=3, std=0.05, head_std=0.5, draft_ids=ids
        )
        write_hub_checkpoint(root / name, raw, tensors)
        out[name] = (str(root / name), tensors, raw)
    return out


@pytest.fixture(scope="module")
def models(drafts) -> dict:
    return {
        name: mtp_jax.load(TARGET, "float32", strict=True, draft_model=d[0]) for name, d in drafts.items()
    }


# --- the independent reference (float64 numpy, the paper's Eq. 2-7) -------------------------------
def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def reference_dspark(t, raw, tokens, embed, head, perturb=None) -> tuple[np.ndarray, np.ndarray | None]:
    """(logits [b, T, B, V], confidence logits [b, T, B] or None) of the block anchored at each
    token: slot k's previous token is token i + k (teacher forcing), past the end the argmax of
    slot k - 1. ``perturb``: "no_bias" (the base logits alone), "shifted" (the slot's own target
    token as its previous one), "dflash_rows" (slots read from block rows 1.. as DFlash does)."""
    f64 = np.float64
    dflash_view = {**raw, "dflash_config": {"mask_token_id": raw["mask_token_id"]}}
    ids = raw["target_layer_ids"]
    h = reference_block_states(t, dflash_view, REF["hidden_states"], tokens, ids, embed)  # [b, T, B, d]
    if perturb == "dflash_rows":
        h = np.concatenate([h[:, :, 1:], h[:, :, -1:]], 2)
    vocab_ids = np.arange(len(t["d2t"])) + t["d2t"] if "d2t" in t else None  # a draft vocabulary
    t = {k: np.asarray(v, f64) for k, v in t.items()}
    base = h @ np.asarray(head, f64).T
    if vocab_ids is not None:  # its logits at its ids only (-inf at the others), W2 over them
        base = np.where(np.isin(np.arange(base.shape[-1]), vocab_ids), base, -np.inf)
    b, n, bs, _ = h.shape
    r, kind = raw["markov_rank"], raw.get("markov_head_type", "vanilla")
    temps = raw.get("confidence_temperatures") or [1.0] * bs
    shifts = raw.get("confidence_shifts") or [0.0] * bs
    logits, conf = np.zeros_like(base), np.zeros((b, n, bs))
    for row in range(b):
        for i in range(n):
            prev, state = tokens[row, i], np.zeros(r)
            for k in range(bs):
                j = i + k + (1 if perturb == "shifted" else 0)
                if j < n:
                    prev = tokens[row, j]
                hk = h[row, i, k]
                bias = np.zeros(base.shape[-1])
                if r:
                    e = t["markov_head.markov_w1.weight"][prev]
                    w2 = t["markov_head.markov_w2.weight"]  # [V, r]: bias = u @ w2.T
                    if kind == "vanilla":
                        u = e
                    elif kind == "gated":
                        g = t["markov_head.gate_proj.weight"] @ np.concatenate([hk, e])
                        u = _sigmoid(g + t["markov_head.gate_proj.bias"]) * e
                    else:
                        z = t["markov_head.joint_proj.weight"] @ np.concatenate([state, e, hk])
                        gate, cand, o = np.split(z + t["markov_head.joint_proj.bias"], 3)
                        state = _sigmoid(gate) * state + (1 - _sigmoid(gate)) * np.tanh(cand)
                        u = np.tanh(o)
                    bias = w2 @ u
                    if vocab_ids is not None:
                        bias = np.zeros(base.shape[-1]).copy()
                        bias[vocab_ids] = w2 @ u
                if perturb == "no_bias":
                    bias = 0 * bias
                logits[row, i, k] = base[row, i, k] + bias
                if raw["enable_confidence_head"]:
                    x = hk
                    if r and raw.get("confidence_head_with_markov", True):
                        x = np.concatenate([hk, t["markov_head.markov_w1.weight"][prev]])
                    w, c = t["confidence_head.proj.weight"][0], t["confidence_head.proj.bias"][0]
                    conf[row, i, k] = (w @ x + c) / temps[k] + shifts[k]
                prev = int(np.argmax(logits[row, i, k]))
    return logits, (conf if raw["enable_confidence_head"] else None)


def _rel(got, want) -> float:
    """Relative error over the finite entries (a draft vocabulary's logits are -inf at the other
    target ids: those must agree exactly)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    got, want = np.where(np.isfinite(want), got, 0.0), np.where(np.isfinite(want), want, 0.0)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _teacher_forced(model, tokens):
    from mtp_jax.drafts.dspark.draft import dspark_features, teacher_forced_block

    cfg = model.draft_config
    hidden = model.hidden_states(tokens, cfg.capture)
    features = dspark_features(cfg, hidden)
    return jax.jit(teacher_forced_block, static_argnums=1)(model.params, cfg, jnp.asarray(tokens), features)


# --- the forward -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_draft_logits_and_confidences_match_the_papers_equations(drafts, models, name):
    _, tensors, raw = drafts[name]
    model = models[name]
    tokens = REF["input_ids"]
    got = model.draft_logits(tokens)
    bs = raw["block_size"]
    assert got.shape == (*tokens.shape, bs, 128) and got.dtype == np.float32
    embed, head = _target_arrays(model)
    want, want_conf = reference_dspark(tensors, raw, tokens, embed, head)
    assert _rel(got, want) < 1e-5
    # each way of getting the equations wrong moves the logits far outside that tolerance
    for perturb in ("dflash_rows",) + (("no_bias", "shifted") if raw["markov_rank"] else ()):
        wrong, _ = reference_dspark(tensors, raw, tokens, embed, head, perturb)
        assert _rel(got, wrong) > 1e-2, perturb
    logits, conf = _teacher_forced(model, tokens)
    np.testing.assert_allclose(np.asarray(logits), got, rtol=1e-6, atol=1e-6)
    if raw.get("draft_vocab_size"):  # nothing outside the draft vocabulary can be drafted
        outside = np.setdiff1d(np.arange(128), VOCAB_IDS)
        assert np.isneginf(got[..., outside]).all() and np.isfinite(got[..., VOCAB_IDS]).all()
    if want_conf is None:
        assert conf is None
    else:
        np.testing.assert_allclose(np.asarray(conf), want_conf, rtol=1e-4, atol=1e-5)


def test_config_fields_and_capture(models):
    a, r = models["a"].draft_config, models["r"].draft_config
    assert a.capture == (-1, 1) and r.capture == (0,)  # -1: the embedding output
    assert (a.markov_rank, a.markov_head_type, a.confidence_head, a.confidence_width) == (
        8,
        "vanilla",
        True,
        40,
    )
    assert models["g"].draft_config.confidence_width == 32  # without the Markov feature
    assert r.confidence_temperatures == (1.5, 0.8, 2.0) and r.resized(2).confidence_temperatures == (1.5, 0.8)
    assert r.confidence_shifts == (0.3, -0.7, 0.0) and r.resized(2).confidence_shifts == (0.3, -0.7)
    assert models["0"].draft_config.markov_rank == 0 and "markov" not in models["0"].params["dspark"]


def test_deepspec_layout_round_trips_bit_exact(drafts, models, target, tmp_path):
    """Our writer gives back every tensor the checkpoint holds, frozen copies included, and a
    config.json that loads to the same draft."""
    from mtp_jax.drafts.dspark.checkpoint import dspark_config_dict, dspark_hub_tensors_from_params

    for name, (_, tensors, raw) in drafts.items():
        model = models[name]
        back = dspark_hub_tensors_from_params(model.params["dspark"], model.draft_config, model.params)
        assert sorted(back) == sorted(tensors), name
        for key, value in tensors.items():
            assert back[key].dtype == value.dtype and np.array_equal(back[key], value), (name, key)
        with open(os.path.join(TARGET, "config.json")) as f:
            written = dspark_config_dict(model.draft_config, json.load(f))
        for key, value in raw.items():
            if key not in ("model_type", "num_anchors"):
                assert written[key] == value, (name, key)
        write_hub_checkpoint(tmp_path / name, written, back)
        again = mtp_jax.load(TARGET, "float32", strict=True, draft_model=str(tmp_path / name))
        assert dataclasses.replace(again.draft_config) == model.draft_config


# --- in the unified step ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a", "r", "g", "v"])
def test_decode_block_samples_each_slot_from_its_biased_distribution(models, name):
    """extend_and_propose on whole prompts: greedy drafts are the teacher-forced block's argmax chain
    at the last token; sampled drafts come with q at slot k = the processed softmax of the block's
    logits given the drafts actually drawn before it (recomputed by teacher forcing on the prompt
    followed by those drafts), not given the argmax chain."""
    from mtp_jax.drafts.dspark.draft import DRAFT
    from mtp_jax.sampling import RowSampling, draft_probs
    from mtp_jax.step import StepConfig

    model = models[name]
    cfg = model.draft_config
    ids = jnp.asarray(REF["input_ids"])
    b, t = ids.shape
    rows, table, first_pos, page, pages = prompt_rows(model, ids)
    sampling = RowSampling.build(b, temperature=[1.0] * b, seed=list(range(b)))
    extend_and_propose = jax.jit(DRAFT.extend_and_propose, static_argnums=1)
    k = cfg.block_size
    greedy_logits = np.asarray(model.draft_logits(REF["input_ids"])[:, t - 1])
    differs = 0
    for mode in ("argmax", "sampled"):
        sc = StepConfig(model.config, page, k, "dspark", mode, draft_cfg=cfg)
        state = DRAFT.init_state(sc, pages, jnp.float32)
        out = extend_and_propose(model.params, sc, state, table, rows, jnp.ones(b, bool), sampling, first_pos)
        assert len(out) == 4  # with a confidence head: the drafts' confidence logits too
        drafts, q, state, conf = out
        drafts = np.asarray(drafts)
        logits, want_conf = _teacher_forced(model, np.concatenate([np.asarray(ids), drafts], 1))
        # each slot's confidence reads the draft before it, as drawn
        np.testing.assert_allclose(np.asarray(conf), np.asarray(want_conf)[:, t - 1], rtol=1e-4, atol=1e-5)
        if mode == "argmax":
            np.testing.assert_array_equal(drafts, np.argmax(greedy_logits, -1))
            continue
        want = np.asarray(logits)[:, t - 1]  # the block at the last prompt token, given the drafts
        expect = np.stack([draft_probs(jnp.asarray(want[:, j]), sampling) for j in range(k)], 1)
        np.testing.assert_allclose(np.asarray(q), expect, rtol=1e-4, atol=1e-6)
        finite = np.isfinite(want)  # a draft vocabulary's -inf elsewhere
        gap = np.where(finite, want, 0.0) - np.where(finite, greedy_logits, 0.0)
        differs += int(np.abs(gap).max() > 1e-3)
        if name == "v":
            assert (
                np.isin(drafts, VOCAB_IDS).all()
                and not np.asarray(q)[..., ~np.isin(np.arange(128), VOCAB_IDS)].any()
            )
    assert differs, "the sampled drafts left the argmax chain nowhere: the check would not see a wrong prefix"


PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_speculation_is_lossless(models, name):
    model = models[name]
    plain = model.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
    for k in (1, model.draft_config.block_size):
        out = model.generate(
            PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3, draft="dspark", num_speculative_tokens=k
        )
        assert out.tokens == plain.tokens, k
        assert out.stats["acceptance_length"] > 1.0, (k, out.stats)  # not vacuous: drafts were accepted
    default = model.generate(PROMPTS[:1], max_new_tokens=4, ignore_eos=True, draft="dspark")
    assert default.stats["num_speculative_tokens"] == model.draft_config.block_size
    small = model.generate(
        PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3, draft="dspark", draft_block_size=2
    )
    assert small.tokens == plain.tokens and small.stats["num_speculative_tokens"] == 2
    if name == "a":
        check_per_request_k(model, "dspark", PROMPTS, plain.tokens)


@pytest.mark.parametrize("name", ["a", "r"])
def test_each_step_reports_the_confidences_of_the_drafts_it_verified(models, name):
    """``on_verified`` (the calibration's rollouts): after each step, the confidence logits of the
    drafts it verified are the draft's own at that block (the teacher-forced ones over the final
    text, as far as its drafts were accepted: their previous tokens are then the text's), and the
    verified and accepted counts add up to the run's statistics. Draft "r" is calibrated: its logits
    come divided by their temperatures."""
    model = models[name]
    k = model.draft_config.block_size
    records = []
    prompt = PROMPTS[1]
    out = model.generate(
        [prompt],
        max_new_tokens=14,
        ignore_eos=True,
        draft="dspark",
        num_speculative_tokens=k,
        on_verified=lambda z, v, a: records.append((z.copy(), v.copy(), a.copy())),
    )
    text = prompt + out.tokens[0]
    _, conf = _teacher_forced(model, np.array([text]))
    conf = np.asarray(conf)[0]
    s, compared = len(prompt), 0
    for z, verified, accepted in records:
        assert z.shape == (1, k) and 0 <= accepted[0] <= verified[0] <= k
        upto = min(int(accepted[0]) + 1, int(verified[0]), len(text) - s)
        np.testing.assert_allclose(z[0, :upto], conf[s, :upto], rtol=1e-4, atol=1e-5)
        compared += upto
        s += int(accepted[0]) + 1
    assert compared > len(records)  # some steps compared more than their first draft
    assert sum(int(a[0]) for _, _, a in records) == out.stats["num_accepted_tokens"] > 0
    assert sum(int(v[0]) for _, v, _ in records) == out.stats["num_draft_tokens"]
    # the run's expected accepted drafts: the running products of sigmoid(z) over the verified drafts
    expected = 0.0
    for z, verified, _ in records:
        expected += float(np.sum(np.cumprod(1 / (1 + np.exp(-z[0].astype(np.float64))))[: int(verified[0])]))
    assert out.stats["expected_accepted_tokens"] == pytest.approx(expected, rel=1e-9) and expected > 0


def test_confidences_are_reported_only_by_a_draft_that_has_them(models):
    with pytest.raises(InvalidRequestError, match="on_verified needs a draft that estimates its confidence"):
        models["0"].generate(PROMPTS[:1], max_new_tokens=4, draft="dspark", on_verified=print)


def test_on_deepseek_v3(target, tmp_path):
    """The same draft class on the MLA + MoE target: loaded against its embedding and head, greedy
    speculation lossless and accepted."""
    deepseek = mtp_jax.load(DEEPSEEK_TARGET, "float32")
    cfg = deepseek.config
    raw = {
        **DSPARK_A,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_hidden_layers,
        "target_layer_ids": [-1, cfg.num_hidden_layers - 2],
        "mask_token_id": cfg.vocab_size - 1,
    }
    embed, head = _target_arrays(deepseek)
    tensors = dspark_hub_tensors(DSparkConfig.from_dict(raw), embed, head, 3, 0.05, 0.5)
    write_hub_checkpoint(tmp_path / "draft", raw, tensors)
    model = mtp_jax.load(DEEPSEEK_TARGET, "float32", strict=True, draft_model=str(tmp_path / "draft"))
    prompts = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13], [100]]
    plain = model.generate(prompts, max_new_tokens=12, ignore_eos=True)
    out = model.generate(prompts, max_new_tokens=12, ignore_eos=True, draft="dspark")
    assert out.tokens == plain.tokens
    assert out.stats["acceptance_length"] > 1.0, out.stats


# --- errors ----------------------------------------------------------------------------------------
def _bad(tmp_path, drafts, raw=None, drop=(), change=None) -> str:
    _, tensors, base = drafts["a"]
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    if change:
        tensors = {**tensors, **change}
    write_hub_checkpoint(tmp_path / "draft", raw or base, tensors)
    return str(tmp_path / "draft")


def test_bad_drafts_are_refused_by_name(tmp_path, drafts, models):
    def load(path):
        return mtp_jax.load(TARGET, "float32", strict=True, draft_model=path)

    cases = [
        ({**DSPARK_A, "markov_head_type": "lstm"}, (), None, ConfigError, "markov_head_type 'lstm'"),
        ({**DSPARK_A, "target_layer_ids": [0, 2]}, (), None, ConfigError, "final layer is not allowed"),
        ({**DSPARK_A, "target_layer_ids": [1, 0]}, (), None, ConfigError, "strictly increasing"),
        ({**DSPARK_A, "num_target_layers": 36}, (), None, ConfigError, "made for a target of 36 layers"),
        ({k: v for k, v in DSPARK_A.items() if k != "mask_token_id"}, (), None, ConfigError, "mask_token_id"),
        ({**DSPARK_A, "confidence_temperatures": [1.0]}, (), None, ConfigError, "4 positive numbers"),
        ({**DSPARK_A, "confidence_shifts": [0, 0, 0, "1"]}, (), None, ConfigError, "4 finite numbers"),
        ({**DSPARK_A, "attention_bias": True}, (), None, ConfigError, "attention_bias"),
        (None, ("markov_head.markov_w2.weight",), None, CheckpointError, "markov_w2"),
        (None, ("confidence_head.proj.bias",), None, CheckpointError, "confidence_head.proj.bias"),
    ]
    wrong_embed = np.asarray(drafts["a"][1]["embed_tokens.weight"]) + 1.0
    cases.append((None, (), {"embed_tokens.weight": wrong_embed}, ConfigError, "trained for another model"))
    for i, (raw, drop, change, error, match) in enumerate(cases):
        with pytest.raises(error, match=match):
            load(_bad(tmp_path / str(i), drafts, raw, drop, change))
    model = models["a"]
    with pytest.raises(InvalidRequestError, match="proposes at most 4"):
        model.generate(PROMPTS[:1], max_new_tokens=4, draft="dspark", num_speculative_tokens=5)
    with pytest.raises(InvalidRequestError, match=r"draft_block_size must be an integer in \[1, 4\]"):
        model.generate(PROMPTS[:1], max_new_tokens=4, draft="dspark", draft_block_size=5)


# --- training losses ---------------------------------------------------------------------------------
def test_training_losses_match_deepspecs_definitions():
    """Cross-entropy, the L1 distance (twice the total variation) and the confidence BCE against
    sum(min(p_d, p_t)) = 1 - TV, slot k weighted exp(-k / 4) over each block's valid prefix, against
    a float64 loop; the confidence targets carry no gradient."""
    from mtp_jax.drafts.dspark.losses import LossWeights, dspark_losses

    rng = np.random.default_rng(1)
    n, bs, v = 5, 4, 11
    draft, target = rng.normal(size=(n, bs, v)) * 2, rng.normal(size=(n, bs, v)) * 2
    labels, conf = rng.integers(0, v, (n, bs)), rng.normal(size=(n, bs))
    valid = rng.uniform(size=(n, bs)) > 0.2
    got = dspark_losses(
        jnp.asarray(draft), jnp.asarray(target), jnp.asarray(labels), jnp.asarray(valid), jnp.asarray(conf)
    )
    sums = {"ce": 0.0, "l1": 0.0, "confidence": 0.0, "acceptance": 0.0}
    total = 0.0
    for i in range(n):
        for k in range(bs):
            if not valid[i, : k + 1].all():
                break  # a contiguous valid prefix only
            w = np.exp(-k / 4.0)
            pd = np.exp(draft[i, k] - draft[i, k].max())
            pd /= pd.sum()
            pt = np.exp(target[i, k] - target[i, k].max())
            pt /= pt.sum()
            c_star = np.minimum(pd, pt).sum()
            assert c_star == pytest.approx(1 - 0.5 * np.abs(pd - pt).sum())
            sig = 1 / (1 + np.exp(-conf[i, k]))
            sums["ce"] += w * -np.log(pd[labels[i, k]])
            sums["l1"] += w * np.abs(pd - pt).sum()
            sums["confidence"] += w * -(c_star * np.log(sig) + (1 - c_star) * np.log(1 - sig))
            sums["acceptance"] += w * c_star
            total += w
    for key, value in sums.items():
        assert float(got[key]) == pytest.approx(value / total, rel=1e-5), key
    want = 0.1 * sums["ce"] / total + 0.9 * sums["l1"] / total + sums["confidence"] / total
    assert float(got["loss"]) == pytest.approx(want, rel=1e-5)
    dflash_like = dspark_losses(
        jnp.asarray(draft),
        jnp.asarray(target),
        jnp.asarray(labels),
        jnp.asarray(valid),
        None,
        LossWeights(1.0, 0.0, 0.0),
    )
    assert float(dflash_like["loss"]) == pytest.approx(sums["ce"] / total, rel=1e-5)

    def confidence_term(d):
        return dspark_losses(
            d, jnp.asarray(target), jnp.asarray(labels), jnp.asarray(valid), jnp.asarray(conf)
        )["confidence"]

    assert not np.any(np.asarray(jax.grad(confidence_term)(jnp.asarray(draft, jnp.float32))))


def test_sequential_temperature_scaling_recovers_the_true_temperatures():
    """Rollouts whose slot-k acceptance (given the slots before) is sigmoid(z_k / T*_k): the fit,
    slot by slot against the prefix labels, finds T* within 10% and leaves the cumulative products
    calibrated (ECE under 1.5%) where the raw head's are not (over 5%)."""
    from mtp_jax.drafts.dspark.calibration import expected_calibration_error, fit_temperatures, prefix_labels

    rng = np.random.default_rng(0)
    n, true = 40_000, np.array([2.0, 0.5, 1.5])
    z = rng.normal(1.0, 2.0, (n, 3))
    c = 1 / (1 + np.exp(-z / true))
    accepted = np.sum(np.cumprod(rng.uniform(size=(n, 3)) < c, axis=1), axis=1)
    proposed = rng.integers(1, 4, n)  # rollouts verified 1..3 drafts
    accepted = np.minimum(accepted, proposed)
    labels, observed = prefix_labels(accepted, proposed, 3)
    temps = fit_temperatures(z, labels, observed)
    np.testing.assert_allclose(temps, true, rtol=0.1)

    def ece(t):
        a = np.cumprod(1 / (1 + np.exp(-z / np.asarray(t))), axis=1)
        return [expected_calibration_error(a[observed[:, k], k], labels[observed[:, k], k]) for k in range(3)]

    assert max(ece(temps)) < 0.015 and max(ece([1.0, 1.0, 1.0])) > 0.05


def test_a_shift_removes_the_bias_a_temperature_cannot():
    """An overconfident head (slot-k acceptance sigmoid(z_k / T* + s*) with shifts of -1.5..-0.5,
    as a draft trained on greedy replies and rolled out at temperature 1 is): fit_scaling finds T*
    and s* and, on fresh rollouts, expects the accepted drafts per step that are observed (within
    4%; 2% here); the temperature alone cannot (its expectation is over 15% high: 68% here), nor
    can the raw head."""
    from mtp_jax.drafts.dspark.calibration import fit_scaling, fit_temperatures, prefix_labels

    true_t, true_s = np.array([2.0, 0.5, 1.5]), np.array([-1.5, -0.5, -1.0])

    def rollouts(seed: int, n: int = 10_000):
        rng = np.random.default_rng(seed)
        z = rng.normal(1.0, 2.0, (n, 3))
        c = 1 / (1 + np.exp(-(z / true_t + true_s)))
        proposed = rng.integers(1, 4, n)
        accepted = np.minimum(np.sum(np.cumprod(rng.uniform(size=(n, 3)) < c, axis=1), axis=1), proposed)
        return z, proposed, accepted

    z, proposed, accepted = rollouts(0)
    labels, observed = prefix_labels(accepted, proposed, 3)
    temps, shifts = fit_scaling(z, labels, observed)
    alone = fit_temperatures(z, labels, observed)
    np.testing.assert_allclose(temps, true_t, rtol=0.15)
    np.testing.assert_allclose(shifts, true_s, atol=0.25)

    z, proposed, accepted = rollouts(1)  # measured on rollouts the fit never saw
    observed = prefix_labels(accepted, proposed, 3)[1]

    def expected(t, s=(0.0, 0.0, 0.0)) -> float:
        a = np.cumprod(1 / (1 + np.exp(-(z / np.asarray(t) + np.asarray(s)))), axis=1)
        return float(np.sum(np.where(observed, a, 0.0)) / len(z))

    seen = float(np.mean(accepted))
    assert expected(temps, shifts) == pytest.approx(seen, rel=0.04)
    assert expected(alone) > 1.15 * seen
    assert expected((1.0, 1.0, 1.0)) > 1.15 * seen


# --- on a mesh ---------------------------------------------------------------------------------------
SHARDED_CHILD = textwrap.dedent(
    """
    import os, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    assert len(jax.devices()) == 8
    import mtp_jax
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from tests.drafts.test_dspark import DSPARK_A, DSPARK_R, _target_arrays
    from tests.drafts.test_eagle3 import DEEPSEEK_TARGET, TARGET, check_planned_draft

    tmp = tempfile.mkdtemp()
    prompts = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [10], [8, 8, 8, 8, 8, 8, 8]]
    spec = dict(max_new_tokens=10, ignore_eos=True, draft="dspark", num_speculative_tokens=3)
    sampled = dict(spec, temperature=0.9, top_k=20, seed=[1, 2, 3, 4])
    scheduled = dict(spec, schedule="confidence", sps_table={4: [1.0, 0.9, 0.8, 0.7]})
    for name, target, raw, axes in [
        ("llama", TARGET, DSPARK_A, dict(data=4, tensor=2)),
        ("llama-rnn", TARGET, DSPARK_R, dict(data=2, tensor=4)),
        ("deepseek", DEEPSEEK_TARGET, None, dict(data=2, expert=4)),
    ]:
        one = mtp_jax.load(target, "float32", page_size=4)
        cfg = one.config
        if raw is None:  # the draft at the DeepSeek-V3 target's width and vocabulary
            n = cfg.num_hidden_layers
            raw = dict(DSPARK_A, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_target_layers=n,
                       target_layer_ids=[-1, n - 2], mask_token_id=cfg.vocab_size - 1)
        embed, head = _target_arrays(one)
        path = os.path.join(tmp, name)
        tensors = dspark_hub_tensors(DSparkConfig.from_dict(raw), embed, head, 3, 0.05, 0.5)
        write_hub_checkpoint(path, raw, tensors)
        one = mtp_jax.load(target, "float32", page_size=4, draft_model=path)
        want_logits = one.draft_logits([prompts[1]])
        want = {how: one.generate(prompts, **kw).tokens for how, kw in
                (("argmax", spec), ("sampled", sampled), ("scheduled", scheduled))}
        mesh = mtp_jax.make_mesh(**axes)
        model = mtp_jax.load(target, "float32", page_size=4, draft_model=path, mesh=mesh)
        np.testing.assert_allclose(model.draft_logits([prompts[1]]), want_logits, rtol=2e-5, atol=2e-5)
        for how, kw in (("argmax", spec), ("sampled", sampled), ("scheduled", scheduled)):
            assert model.generate(prompts, **kw).tokens == want[how], (name, axes, how)
        if name == "llama":
            check_planned_draft(model, mesh, axes, "dspark", 3, "DSpark K=3")
    print("DSPARK-SHARDED-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(SHARDED_CHILD)
def test_sharded_like_the_target(child_output):
    """On meshes as DFlash runs (tensor-parallel Llama, expert-parallel DeepSeek-V3): the block's
    logits, greedy, sampled and confidence-scheduled tokens equal one device's."""
    assert "DSPARK-SHARDED-OK" in child_output


def test_with_lora_rows_prefix_caching_and_chunked_prefill(drafts, tmp_path):
    """What the other drafts have, with DSpark: a LoRA adapter on the target's rows beside a row
    without one, and an engine whose prompts share a cached prefix and arrive in chunks, give plain
    decoding's tokens (drafts verified with the adapter)."""
    from tests.test_lora import write_random_adapter

    plain = mtp_jax.load(TARGET, "float32")
    adapter = write_random_adapter(tmp_path / "a", plain, 4, ["q_proj", "down_proj"], seed=4, alpha=4)
    model = mtp_jax.load(TARGET, "float32", draft_model=drafts["a"][0], lora_adapters={"a": adapter})
    kw = dict(max_new_tokens=12, ignore_eos=True, lora=["a", None, "a"], max_batch=3)
    want = model.generate(PROMPTS[:3], **kw).tokens
    assert want[0] != plain.generate(PROMPTS[:1], max_new_tokens=12, ignore_eos=True).tokens[0]
    out = model.generate(PROMPTS[:3], draft="dspark", **kw)
    assert out.tokens == want and out.stats["num_draft_tokens"] > 0
    long = [5, 9, 17, 3, 8, 8, 8, 8, 40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5, 100] * 2
    prompts = [long + [11, 12], long + [30]]
    want = model.generate(prompts, max_new_tokens=10, ignore_eos=True).tokens
    spec = mtp_jax.SpeculativeConfig(draft="dspark", num_speculative_tokens=4)
    with mtp_jax.Engine(model, speculative=spec, slots=2, max_len=64, chunked_prefill_size=16) as engine:

        def run(prompt):
            return list(engine.submit(prompt, max_new_tokens=10, ignore_eos=True).result(timeout=300).tokens)

        got, again = [run(p) for p in prompts], run(prompts[0])
        stats = engine.stats()
    assert got == want and again == want[0]
    assert stats["prefix_cache_hits"] > 0


def test_grammar_masks_on_a_target_with_a_tokenizer(tmp_path, monkeypatch):
    """A grammar (a regex) constrains the target's tokens under DSpark speculation as under plain
    decoding: the embedded tiny Llama 3 with a random DSpark draft written by
    scripts/random_dspark.py."""
    from tests.conftest import REPO, require_extra
    from tests.scripts.test_train_tiny import import_script

    require_extra("llguidance")
    target = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
    script = import_script(os.path.join(REPO, "scripts", "random_dspark.py"))
    draft = str(tmp_path / "dspark")
    monkeypatch.setattr(
        "sys.argv", ["random_dspark.py", "--target", target, "--out", draft, "--block-size", "4"]
    )
    assert script.main() == 0
    model = mtp_jax.load(target, "float32", draft_model=draft)
    grammar = {"regex": r"def [a-z_]+\(x\): return x( [+*] [0-9])*"}
    kw = dict(max_new_tokens=24, grammar=grammar)
    plain = model.generate(["# a function\n", "# another\n"], **kw)
    spec = model.generate(["# a function\n", "# another\n"], **kw, draft="dspark", num_speculative_tokens=4)
    assert spec.tokens == plain.tokens and spec.stats["num_draft_tokens"] > 0
    assert all(t.startswith("def ") for t in plain.texts)


@pytest.mark.parametrize("name", ["a", "v"])
def test_plan_declares_the_loaders_tree(models, name):
    """``Draft.abstract_params`` (mtp-jax plan, random-weight timings): the loaded draft's structure,
    shapes and dtypes, a draft vocabulary's head columns and map included."""
    from mtp_jax.plan import abstract_params
    from mtp_jax.sharding import make_mesh

    model = models[name]
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    abstract = abstract_params(model.config, mesh, jnp.float32, weights="bf16", draft_cfg=model.draft_config)
    real = model.params["dspark"]
    assert jax.tree.structure(abstract["dspark"]) == jax.tree.structure(real)
    for a, r in zip(jax.tree.leaves(abstract["dspark"]), jax.tree.leaves(real), strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)
    if name == "v":
        assert real["markov"]["w2"].shape == (8, 96) and real["lm_head"].shape == (32, 96)
