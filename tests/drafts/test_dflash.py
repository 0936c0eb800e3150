"""DFlash drafts: the block forward against an independent float64 reference of the published math
(docs/formats.md, "DFlash drafts") on transformers' own hidden states, the decode-time block over the
paged context against it, speculative generation with it, and the errors a bad draft gets."""

from __future__ import annotations

import copy
import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.drafts.dflash.config import DFlashConfig, dflash_capture, dflash_default_layers
from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
from mtp_jax.errors import ConfigError, InvalidRequestError
from tests.conftest import check_per_request_k
from tests.drafts.test_eagle3 import DRAFT_A as EAGLE3_DRAFT
from tests.drafts.test_eagle3 import REF, TARGET, _inv_freq, _rms, _rope  # L = 3, d = 32, V = 128

# Two layers, GQA 4/2, its own llama3-scaled rope, a block of 4, captured outputs of layers 0 and 2.
DRAFT_A = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000.0,
    "rope_scaling": EAGLE3_DRAFT["rope_scaling"],  # llama3-scaled
    "max_position_embeddings": 512,
    "block_size": 4,
    "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 2]},
}
# One layer, block_size inside dflash_config, the default layer choice (one layer: the middle).
DRAFT_B = {
    **{k: v for k, v in DRAFT_A.items() if k not in ("block_size", "rope_scaling")},
    "num_hidden_layers": 1,
    "num_key_value_heads": 4,
    "dflash_config": {"mask_token_id": 3, "block_size": 5},
}
# DRAFT_A over a draft vocabulary of 48 of the target's 128 ids (mtp-jax's extension: ``d2t``): as a
# vocabulary of the most frequent tokens would, it holds the 26 the target emits greedily on PROMPTS.
_EMITTED = [
    5,
    9,
    11,
    14,
    18,
    19,
    23,
    31,
    32,
    36,
    38,
    42,
    44,
    51,
    52,
    55,
    56,
    62,
    73,
    79,
    81,
    85,
    106,
    110,
    126,
    127,
]
_OTHERS = np.random.default_rng(5).permutation(np.setdiff1d(np.arange(128), _EMITTED))[:22]
VOCAB_IDS = np.sort(np.concatenate([_EMITTED, _OTHERS]))
DRAFT_V = {**DRAFT_A, "draft_vocab_size": len(VOCAB_IDS)}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict:
    """name -> (draft directory, its tensors, its raw config)."""
    root = tmp_path_factory.mktemp("dflash")
    out = {}
    for name, raw, n_features in (("a", DRAFT_A, 2), ("b", DRAFT_B, 1), ("v", DRAFT_V, 2)):
        ids = VOCAB_IDS if name == "v" else None  # "v": a's weights (the same seed) and a vocabulary
        cfg = DFlashConfig.from_dict(raw)
        seed = 17 if name == "b" else 4  # random drafts whose greedy drafts the target sometimes accepts
        tensors = dflash_hub_tensors(cfg, n_features, seed=seed, std=0.2, draft_ids=ids)
        write_hub_checkpoint(root / name, raw, tensors)
        out[name] = (str(root / name), tensors, raw)
    return out


@pytest.fixture(scope="module")
def models(drafts) -> dict:
    return {
        name: mtp_jax.load(TARGET, "float32", strict=True, draft_model=d[0]) for name, d in drafts.items()
    }


# --- the independent reference ------------------------------------------------------------------
def reference_block_logits(t, raw, hidden_states, tokens, ids, embed, head, perturb=None) -> np.ndarray:
    """float64 [b, T, B-1, V] by the published recipe, one anchor at a time. ``perturb`` makes one
    mistake: "causal_block" (a causal mask inside the block), "see_anchor" (the context includes
    the anchor's own position), "inputs" (captured ids read as layer inputs)."""
    states = reference_block_states(t, raw, hidden_states, tokens, ids, embed, perturb)
    return states[:, :, 1:] @ np.asarray(head, np.float64).T


def reference_block_states(t, raw, hidden_states, tokens, ids, embed, perturb=None) -> np.ndarray:
    """float64 norm(x) [b, T, B, d] of the block anchored at each token (see
    :func:`reference_block_logits`; captured id i reads ``hidden_states[i + 1]``, -1 the
    embedding)."""
    f64 = np.float64
    t = {k: np.asarray(v, f64) for k, v in t.items()}
    eps, bs = raw["rms_norm_eps"], raw.get("block_size") or raw["dflash_config"]["block_size"]
    mask = raw["dflash_config"]["mask_token_id"]
    nh, nkv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    inv = _inv_freq(raw, hd)
    shift = 0 if perturb == "inputs" else 1
    feats = np.concatenate([np.asarray(hidden_states[i + shift], f64) for i in ids], -1)
    c = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    b, n = tokens.shape
    out = np.zeros((b, n, bs, t["norm.weight"].shape[0]))

    def heads(x, w, norm, width, pos):
        y = _rms((x @ w.T).reshape(len(x), width, hd), norm, eps)
        return _rope(y[None], pos.astype(f64), inv)[0]

    for r in range(b):
        for i in range(n):
            x = np.asarray(embed, f64)[[tokens[r, i]] + [mask] * (bs - 1)]
            pos_b = np.arange(i, i + bs)
            seen = i + 1 if perturb == "see_anchor" else i
            pos_c = np.arange(seen)
            for layer in range(raw["num_hidden_layers"]):
                a = f"layers.{layer}.self_attn."
                h = _rms(x, t[f"layers.{layer}.input_layernorm.weight"], eps)
                q = heads(h, t[f"{a}q_proj.weight"], t[f"{a}q_norm.weight"], nh, pos_b)
                kb = heads(h, t[f"{a}k_proj.weight"], t[f"{a}k_norm.weight"], nkv, pos_b)
                kc = heads(c[r, :seen], t[f"{a}k_proj.weight"], t[f"{a}k_norm.weight"], nkv, pos_c)
                vb = (h @ t[f"{a}v_proj.weight"].T).reshape(bs, nkv, hd)
                vc = (c[r, :seen] @ t[f"{a}v_proj.weight"].T).reshape(seen, nkv, hd)
                keys, values = np.concatenate([kc, kb]), np.concatenate([vc, vb])
                att = np.zeros((bs, nh, hd))
                for hh in range(nh):
                    g = hh // (nh // nkv)
                    s = q[:, hh] @ keys[:, g].T / np.sqrt(hd)
                    if perturb == "causal_block":
                        s[:, seen:] = np.where(np.tril(np.ones((bs, bs), bool)), s[:, seen:], -np.inf)
                    p = np.exp(s - s.max(-1, keepdims=True))
                    att[:, hh] = (p / p.sum(-1, keepdims=True)) @ values[:, g]
                x = x + att.reshape(bs, nh * hd) @ t[f"{a}o_proj.weight"].T
                m = f"layers.{layer}.mlp."
                y = _rms(x, t[f"layers.{layer}.post_attention_layernorm.weight"], eps)
                gate, up = y @ t[f"{m}gate_proj.weight"].T, y @ t[f"{m}up_proj.weight"].T
                x = x + (gate / (1 + np.exp(-gate)) * up) @ t[f"{m}down_proj.weight"].T
            out[r, i] = _rms(x, t["norm.weight"], eps)
    return out


def _target_head(model) -> tuple[np.ndarray, np.ndarray]:
    """(embedding [V, d], head [V, d]) of the loaded target (its loader is checked against
    transformers in tests/targets)."""
    embed = np.asarray(model.params["embed"])
    head = np.asarray(model.params["lm_head"]).T if "lm_head" in model.params else embed
    return embed, head


def _rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# --- the forward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a", "b"])
def test_draft_logits_match_the_published_math(drafts, models, name):
    _, tensors, raw = drafts[name]
    model = models[name]
    tokens = REF["input_ids"]
    got = model.draft_logits(tokens)
    bs = model.draft_config.block_size
    assert got.shape == (*tokens.shape, bs - 1, 128) and got.dtype == np.float32
    ids = model.draft_config.capture
    embed, head = _target_head(model)
    want = reference_block_logits(tensors, raw, REF["hidden_states"], tokens, ids, embed, head)
    assert _rel(got, want) < 1e-5
    # each way of getting the published math wrong moves the logits far outside that tolerance
    for perturb in ("causal_block", "see_anchor", "inputs"):
        wrong = reference_block_logits(tensors, raw, REF["hidden_states"], tokens, ids, embed, head, perturb)
        assert _rel(got, wrong) > 1e-2, perturb


def test_captured_layers_and_defaults(models):
    assert models["a"].draft_config.capture == (0, 2)  # outputs, as written
    assert models["b"].draft_config.capture == (1,)  # one draft layer: the middle of 3
    assert dflash_default_layers(36, 5) == (1, 9, 17, 25, 33)  # docs/formats.md's example
    assert dflash_default_layers(32, 1) == (16,)
    cfg = DFlashConfig.from_dict({**DRAFT_A, "num_target_layers": 36, "dflash_config": {"mask_token_id": 1}})
    assert cfg.block_size == 4 and dflash_capture(cfg, 36) == dflash_default_layers(36, 2)
    with pytest.raises(ConfigError, match="made for a target of 36 layers"):
        dflash_capture(cfg, 3)


def test_export_round_trips_bit_exact(drafts, models):
    from mtp_jax.drafts.dflash.export import dflash_hub_tensors_from_params

    for name, (_, tensors, _) in drafts.items():
        back = dflash_hub_tensors_from_params(models[name].params["dflash"], models[name].draft_config)
        assert sorted(back) == sorted(tensors), name
        for key, value in tensors.items():
            assert back[key].dtype == value.dtype and np.array_equal(back[key], value), (name, key)


def test_a_draft_vocabulary_restricts_the_target_head(drafts, models):
    """Draft "v" is draft "a" with a 48-id draft vocabulary: its block logits are a's at those ids
    (the target head's columns, copied at load) and -inf at every other id; the copy is what the
    step reads instead of the target's head (the roofline counts it as the draft's own head)."""
    from mtp_jax.roofline import step_bytes

    a, v = models["a"], models["v"]
    assert v.draft_config.draft_vocab_size == 48
    np.testing.assert_array_equal(np.asarray(v.params["dflash"]["draft_to_target"]), VOCAB_IDS)
    _, head = _target_head(v)
    np.testing.assert_array_equal(np.asarray(v.params["dflash"]["lm_head"]), head[VOCAB_IDS].T)
    full, got = a.draft_logits(REF["input_ids"]), v.draft_logits(REF["input_ids"])
    np.testing.assert_allclose(got[..., VOCAB_IDS], full[..., VOCAB_IDS], rtol=1e-6, atol=1e-6)
    outside = np.setdiff1d(np.arange(128), VOCAB_IDS)
    assert np.all(got[..., outside] == -np.inf)
    d, k = v.config.hidden_size, 3
    kw = dict(k=k, batch=2, context=9, cache_itemsize=4)
    with_head = step_bytes(a.params, a.config, draft_cfg=a.draft_config, **kw)
    restricted = step_bytes(v.params, v.config, draft_cfg=v.draft_config, **kw)
    assert restricted.draft_heads == pytest.approx(4 * d * 48) and with_head.draft_heads == pytest.approx(
        4 * d * 128
    )
    assert restricted.draft_weights == pytest.approx(with_head.draft_weights + 4 * 48)  # + the int32 ids
    # sampled-mode q is zero outside the vocabulary (what exact acceptance relies on; the chi-square
    # check of a DFlash draft with a vocabulary is in tests/test_acceptance.py)
    out = v.generate(
        PROMPTS, max_new_tokens=6, temperature=1.0, seed=3, draft="dflash", draft_sampling="sampled"
    )
    assert all(len(t) == 6 for t in out.tokens)


def prompt_rows(model, ids):
    """extend_and_propose's inputs for whole prompts ids [b, t] (as prefill hands them to a block
    draft): the rows 0..t-2 with the target's hidden states, a page table, the first draft's
    position (the anchor, the last token, at t - 1), the page size and the number of pages."""
    from mtp_jax.cache import page_table_array
    from mtp_jax.drafts.base import Rows

    cfg = model.draft_config
    b, t = ids.shape
    hidden = model.hidden_states(np.asarray(ids), cfg.capture)
    page = 4
    width = -(-(t + cfg.block_size) // page)
    table = jnp.asarray(page_table_array([list(range(r * width, (r + 1) * width)) for r in range(b)], width))
    cut = hidden._replace(
        post_norm=jnp.asarray(hidden.post_norm)[:, : t - 1],
        pre_norm=jnp.asarray(hidden.pre_norm)[:, : t - 1],
        layers=jnp.asarray(hidden.layers)[:, :, : t - 1],
    )
    rows = Rows(
        tokens=ids[:, : t - 1],
        next_tokens=ids[:, 1:],
        positions=jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1)),
        valid=jnp.ones((b, t - 1), bool),
        hidden=cut,
        last=jnp.full((b,), t - 2),
    )
    return rows, table, jnp.full((b,), t), page, b * width


# --- in the unified step --------------------------------------------------------------------------
def test_decode_block_over_the_paged_context_matches_the_teacher_forced_block(models):
    """extend_and_propose on a whole prompt (as prefill runs it): the context written to the paged
    cache, one block anchored at the last token; its greedy drafts are the argmax of the
    teacher-forced block there, its sampled-mode q the processed softmax of the same logits."""
    from mtp_jax.drafts.dflash.draft import DRAFT
    from mtp_jax.sampling import RowSampling, draft_probs
    from mtp_jax.step import StepConfig

    model = models["a"]
    cfg = model.draft_config
    ids = jnp.asarray(REF["input_ids"])
    b, t = ids.shape
    hidden = model.hidden_states(REF["input_ids"], cfg.capture)
    want = model.draft_logits(REF["input_ids"])[:, t - 1]  # the block anchored at the last token
    rows, table, first_pos, page, pages = prompt_rows(model, ids)
    sampling = RowSampling.build(b, temperature=[0.8] * b)
    # jitted, as the step runs them (op by op they compiled ~250 one-op programs)
    teacher_forced = jax.jit(DRAFT.teacher_forced, static_argnums=1)
    extend_and_propose = jax.jit(DRAFT.extend_and_propose, static_argnums=1)
    # the trained block of 4, and a block of 2 chosen at run time (generate's draft_block_size)
    full_sc = StepConfig(model.config, page, 3, "dflash", draft_cfg=cfg)
    full = teacher_forced(model.params, full_sc, ids, hidden)
    np.testing.assert_allclose(np.asarray(full[:, t - 1]), want, rtol=1e-5, atol=1e-5)
    for block, k, mode in ((4, 3, "argmax"), (4, 3, "sampled"), (2, 1, "argmax"), (2, 1, "sampled")):
        bcfg = dataclasses.replace(cfg, block_size=block)
        sc = StepConfig(model.config, page, k, "dflash", mode, draft_cfg=bcfg)
        want = np.asarray(teacher_forced(model.params, sc, ids, hidden)[:, t - 1])
        if block == 2:  # fewer masked rows in the bidirectional block: another proposal
            assert _rel(want[:, 0], np.asarray(full[:, t - 1, 0])) > 1e-3
        state = DRAFT.init_state(sc, pages, jnp.float32)
        drafts, q, state = extend_and_propose(
            model.params, sc, state, table, rows, jnp.ones(b, bool), sampling, first_pos
        )
        if mode == "argmax":
            np.testing.assert_array_equal(np.asarray(drafts), np.argmax(want[:, :k], -1))
        else:
            expect = np.stack([draft_probs(jnp.asarray(want[:, j]), sampling) for j in range(k)], 1)
            np.testing.assert_allclose(np.asarray(q), expect, rtol=1e-4, atol=1e-6)
    # the context rows of every layer are in the cache at their slots, nothing past them
    k = np.asarray(state["k"][:, table[0]]).reshape(cfg.num_hidden_layers, -1, *state["k"].shape[3:])
    assert np.abs(k[:, : t - 1]).sum(-1).all() and not np.abs(k[:, t - 1 :]).any()


PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]


@pytest.mark.parametrize("name", ["a", "b", "v"])
def test_greedy_speculation_is_lossless(models, name):
    model = models[name]
    plain = model.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
    for k in (1, model.draft_config.block_size - 1):
        out = model.generate(
            PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3, draft="dflash", num_speculative_tokens=k
        )
        assert out.tokens == plain.tokens, k
        assert out.stats["acceptance_length"] > 1.0, (k, out.stats)  # not vacuous: drafts were accepted
    default = model.generate(PROMPTS[:1], max_new_tokens=4, ignore_eos=True, draft="dflash")
    assert default.stats["num_speculative_tokens"] == model.draft_config.block_size - 1
    small = model.generate(  # a smaller block at run time: K defaults to one less
        PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3, draft="dflash", draft_block_size=2
    )
    assert small.tokens == plain.tokens and small.stats["num_speculative_tokens"] == 1
    check_per_request_k(model, "dflash", PROMPTS, plain.tokens)


def test_roofline_counts_the_dflash_draft(models, drafts):
    """scripts/bench_step.py with a DFlash draft: one block forward reads every draft weight once,
    the target's head once for all K rows, the embedding rows of the anchors and the mask, every
    draft layer's context K/V once; then the step it times runs with that draft."""
    from mtp_jax.roofline import build_parser, run, step_bytes

    model, cfg = models["a"], models["a"].draft_config
    k, batch, context = 3, 2, 9
    target = {n: x for n, x in model.params.items() if n != "dflash"}
    plain = step_bytes(target, model.config, k=0, batch=batch, context=context, cache_itemsize=4)
    got = step_bytes(
        model.params, model.config, k=k, batch=batch, context=context, cache_itemsize=4, draft_cfg=cfg
    )
    own = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params["dflash"]))
    d, v = model.config.hidden_size, model.config.vocab_size
    assert got.draft_weights == pytest.approx(4 * (own + d * (batch + 1)))
    assert got.draft_heads == pytest.approx(4 * d * v) and got.draft_experts == 0
    positions = batch * (context + k + 1)
    target_kv = plain.kv / (batch * (context + 1))
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    assert got.kv == pytest.approx(positions * (target_kv + per_token * 4))
    with pytest.raises(ValueError, match="DFlash draft in params"):
        step_bytes(target, model.config, k=1, batch=1, context=4, cache_itemsize=4, draft_cfg=cfg)
    args = ["--model", TARGET, "--draft-model", drafts["a"][0], "--k", "0", "3"]
    out = run(build_parser().parse_args([*args, "--iters", "2", "--copy-mb", "4", "--context", "8"]))
    assert [r["draft"] for r in out["results"]] == [None, "dflash"]
    assert all(r["step_ms"] > 0 for r in out["results"])


# --- bad drafts -----------------------------------------------------------------------------------
def _bad(tmp_path, raw=None, drop=(), n_features=2) -> str:
    raw = copy.deepcopy(raw or DRAFT_A)
    tensors = dflash_hub_tensors(DFlashConfig.from_dict(raw), n_features)
    for key in drop:
        del tensors[key]
    path = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
    write_hub_checkpoint(path, raw, tensors)
    return str(path)


def test_bad_drafts_are_refused_by_name(tmp_path, models):
    cases = [
        ({**DRAFT_A, "hidden_size": 48, "head_dim": 12}, "hidden_size is 48, the target's 32"),
        ({**DRAFT_A, "vocab_size": 256, "dflash_config": {"mask_token_id": 200}}, "vocab_size is 256"),
        ({**DRAFT_A, "vocab_size": None, "dflash_config": {"mask_token_id": 128}}, "outside the target's"),
        ({**DRAFT_A, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 3]}}, "layer 3 is beyond"),
    ]
    for raw, message in cases:
        raw = {k: v for k, v in raw.items() if v is not None}
        with pytest.raises(ConfigError, match=message):
            mtp_jax.load(TARGET, "float32", draft_model=_bad(tmp_path, raw))
    with pytest.raises(Exception, match="missing tensor 'layers.1.self_attn.k_norm.weight'"):
        mtp_jax.load(TARGET, "float32", draft_model=_bad(tmp_path, drop=["layers.1.self_attn.k_norm.weight"]))
    with pytest.raises(Exception, match="fc.weight"):  # fc over 1 layer, config asks for 2
        mtp_jax.load(TARGET, "float32", draft_model=_bad(tmp_path, n_features=1))
    no_d2t = _bad(tmp_path, DRAFT_V)  # draft_vocab_size without the d2t that maps it
    with pytest.raises(Exception, match="no 'd2t' mapping draft ids to target ids"):
        mtp_jax.load(TARGET, "float32", draft_model=no_d2t)
    for raw, message in (
        ({**DRAFT_A, "draft_vocab_size": 200}, r"draft_vocab_size \(200\) exceeds vocab_size \(128\)"),
        ({**DRAFT_A, "dflash_config": {"target_layer_ids": [0]}}, "needs dflash_config.mask_token_id"),
        ({k: v for k, v in DRAFT_A.items() if k != "block_size"}, "needs block_size"),
        ({**DRAFT_A, "dflash_config": {"mask_token_id": 1, "block_size": 8}}, "disagree"),
        ({**DRAFT_A, "block_size": 1}, "at least 2"),
        ({**DRAFT_A, "attention_bias": True}, "attention_bias"),
    ):
        with pytest.raises(ConfigError, match=message):
            DFlashConfig.from_dict(raw)
    with pytest.raises(InvalidRequestError, match="a DFlash block of 4 tokens proposes at most 3"):
        models["a"].generate([[1, 2]], max_new_tokens=2, draft="dflash", num_speculative_tokens=4)
    with pytest.raises(InvalidRequestError, match="a DFlash block of 3 tokens proposes at most 2"):
        models["a"].generate([[1, 2]], draft="dflash", num_speculative_tokens=3, draft_block_size=3)
    with pytest.raises(InvalidRequestError, match=r"draft_block_size must be an integer in \[2, 4\].*got 5"):
        models["a"].generate([[1, 2]], draft="dflash", draft_block_size=5)
    with pytest.raises(
        InvalidRequestError,
        match="draft_block_size=2 is a setting of draft=dspark, dflash, suffix_dflash or suffix_dspark",
    ):
        models["a"].generate([[1, 2]], draft_block_size=2)
    assert jax.tree.leaves(models["a"].params["dflash"]["layers"])[0].shape[0] == 2  # stacked layers


# Sharded like the target on 8 simulated devices: Llama 3 tensor-parallel (draft heads and MLP
# columns split, the paged context's KV heads split over 2) and DeepSeek-V3 expert-parallel (rows
# and their context pages split over data x expert): draft logits, greedy and sampled tokens.
SHARDED_CHILD = textwrap.dedent(
    """
    import os, sys, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    assert len(jax.devices()) == 8
    import mtp_jax
    from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
    from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from mtp_jax.drafts.dflash.config import DFlashConfig
    from tests.conftest import check_per_request_k, TINY_CONFIG
    from tests.drafts.test_dflash import DRAFT_A, DRAFT_V, TARGET, VOCAB_IDS
    from tests.drafts.test_eagle3 import check_planned_draft

    tmp = tempfile.mkdtemp()
    llama_draft, ds_target, ds_draft = (os.path.join(tmp, n) for n in ("llama_draft", "ds", "ds_draft"))
    write_hub_checkpoint(llama_draft, DRAFT_A, dflash_hub_tensors(DFlashConfig.from_dict(DRAFT_A), 2, 1, 0.2))
    vocab_draft = os.path.join(tmp, "vocab_draft")  # a draft vocabulary: the head's columns from a split head
    tensors = dflash_hub_tensors(DFlashConfig.from_dict(DRAFT_V), 2, 1, 0.2, draft_ids=VOCAB_IDS)
    write_hub_checkpoint(vocab_draft, DRAFT_V, tensors)
    write_hub_checkpoint(ds_target, TINY_CONFIG, hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG), seed=0))
    raw = dict(DRAFT_A, vocab_size=97, dflash_config={"mask_token_id": 96, "target_layer_ids": [1, 2]})
    write_hub_checkpoint(ds_draft, raw, dflash_hub_tensors(DFlashConfig.from_dict(raw), 2, 2, 0.2))

    prompts = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [10], [8, 8, 8, 8, 8, 8, 8], [3, 1]]
    spec = dict(max_new_tokens=10, ignore_eos=True, draft="dflash", num_speculative_tokens=3)
    sampled = dict(spec, temperature=0.9, top_k=20, seed=[1, 2, 3, 4, 5])
    for target, draft, meshes in [
        (TARGET, llama_draft, [dict(data=4, tensor=2)]),
        (TARGET, vocab_draft, [dict(data=4, tensor=2)]),
        (ds_target, ds_draft, [dict(data=2, expert=4)]),
    ]:
        one = mtp_jax.load(target, "float32", page_size=4, draft_model=draft)
        want_logits = one.draft_logits([prompts[1]])
        want = {how: one.generate(prompts, draft_sampling=how, **kw).tokens
                for how, kw in (("argmax", spec), ("sampled", sampled))}
        for axes in meshes:
            mesh = mtp_jax.make_mesh(**axes)
            model = mtp_jax.load(target, "float32", page_size=4, draft_model=draft, mesh=mesh)
            np.testing.assert_allclose(model.draft_logits([prompts[1]]), want_logits, rtol=2e-5, atol=2e-5)
            for how, kw in (("argmax", spec), ("sampled", sampled)):
                got = model.generate(prompts, draft_sampling=how, **kw).tokens
                assert got == want[how], (target, axes, how)
            check_planned_draft(model, mesh, axes, "dflash", 3, "DFlash K=3")
    print("DFLASH-SHARDED-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(SHARDED_CHILD)
def test_sharded_like_the_target(child_output):
    assert "DFLASH-SHARDED-OK" in child_output
