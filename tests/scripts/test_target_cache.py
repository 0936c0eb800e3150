"""mtp_jax.train.target_cache as the draft-training scripts use it: the frozen target's features and
teacher, computed once for draft training. With every token kept and float32 features a draft's
losses from the cache equal those from the live target; the truncated teacher's arithmetic; a
killed build resumes to the same bytes; a cache of something else is refused; an end-to-end run
trains from one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.train import target_cache
from mtp_jax.train.frozen import load_params
from tests.conftest import REPO
from tests.scripts.test_train_tiny import finish, import_script

pytestmark = pytest.mark.spawns  # the scripts run as processes

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
SCRIPTS = os.path.join(REPO, "scripts")


@pytest.fixture(scope="module")
def scripts():
    eagle3 = import_script(os.path.join(SCRIPTS, "train_eagle3.py"))
    dflash = import_script(os.path.join(SCRIPTS, "train_dflash.py"))
    return eagle3, dflash, target_cache


@pytest.fixture(scope="module")
def llama():
    from mtp_jax.config import parse_config

    with open(os.path.join(LLAMA, "config.json")) as f:
        raw = json.load(f)
    cfg = parse_config(raw)
    return raw, cfg, load_params(LLAMA, cfg)


def build_for(cache, tmp, cfg, params, capture, features, stream, **kw):
    from mtp_jax.targets import target_for
    from mtp_jax.targets.base import lm_head

    def forward(p, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _ = target_for(cfg).forward(p, cfg, tokens, positions, capture=capture)
        return features(hidden), jax.nn.log_softmax(lm_head(p, hidden.post_norm), -1)

    size = jax.eval_shape(forward, params, jax.ShapeDtypeStruct((1, 2), jnp.int32))[0].shape[-1]
    kw.setdefault("identity", {"target": "tiny-llama3-stdlib", "features": str(capture)})
    return cache.build(str(tmp), forward=forward, params=params, stream=stream, feature_size=size, **kw)


def test_eagle3_losses_from_a_full_cache_equal_the_live_targets(scripts, llama, tmp_path):
    eagle3, _, cache = scripts
    raw, cfg, params = llama
    ids = np.arange(0, cfg.vocab_size, 2, dtype=np.int32)
    draft_raw = eagle3.draft_config(raw, cfg, "gqa", eagle3.spread_layer_ids(cfg.num_hidden_layers), len(ids))
    dcfg, tree = eagle3.init_draft(draft_raw, cfg, params, ids, seed=0)
    stream = np.random.default_rng(0).integers(0, cfg.vocab_size, 300).astype(np.int32)
    built = build_for(
        cache,
        tmp_path / "c",
        cfg,
        params,
        dcfg.capture,
        lambda h: eagle3.fused_features(h.layers),
        stream,
        starts=np.array([40, 140]),
        k=cfg.vocab_size,
        feature_dtype="float32",
    )
    # windows that start where a segment starts see the same context live and cached
    seq = 32
    starts = np.array([0, 40, 40 + 100])
    window = jnp.asarray(np.stack([stream[s : s + seq + 1] for s in starts]))
    rows = {k: jnp.asarray(v) for k, v in built.rows(starts, seq).items()}
    # jitted, as training runs it (op by op it compiled ~350 one-op programs)
    losses = jax.jit(eagle3.draft_losses, static_argnames=("cfg", "dcfg", "depth", "decay"))
    live = losses(tree, params, cfg, dcfg, window, 3, 0.8)[1]
    cached = losses(tree, params, cfg, dcfg, window, 3, 0.8, rows)[1]
    for key in ("loss", "level_loss", "level_agreement", "coverage"):
        np.testing.assert_allclose(np.asarray(cached[key]), np.asarray(live[key]), rtol=2e-4, err_msg=key)
    # a window that starts inside a segment reads features computed with the segment's context
    inside = jnp.asarray(stream[None, 60 : 60 + seq + 1])
    apart = losses(tree, params, cfg, dcfg, inside, 3, 0.8)[1]["loss"]
    from_cache = {k: jnp.asarray(v) for k, v in built.rows(np.array([60]), seq).items()}
    assert (
        abs(float(losses(tree, params, cfg, dcfg, inside, 3, 0.8, from_cache)[1]["loss"]) - float(apart))
        > 1e-4
    )


def test_dflash_losses_from_a_full_cache_equal_the_live_targets(scripts, llama, tmp_path):
    _, dflash, cache = scripts
    raw, cfg, params = llama
    from mtp_jax.drafts.dflash.config import dflash_default_layers
    from mtp_jax.drafts.dflash.draft import dflash_features

    layer_ids = list(dflash_default_layers(cfg.num_hidden_layers, 1))
    draft_raw = dflash.draft_config(raw, cfg, 1, layer_ids, 4, 0)
    dcfg, tree = dflash.init_draft(draft_raw, cfg, 0)
    stream = np.random.default_rng(1).integers(1, cfg.vocab_size, 200).astype(np.int32)
    built = build_for(
        cache,
        tmp_path / "c",
        cfg,
        params,
        dcfg.capture,
        lambda h: dflash_features(dcfg, cfg.num_hidden_layers, h),
        stream,
        starts=None,
        k=cfg.vocab_size,
        feature_dtype="float32",
    )
    seq = 32
    window = jnp.asarray(stream[None, : seq + 1])
    anchors = jnp.asarray(dflash.anchors_for(0, 0, 1, 4, seq, 4))
    rows = {k: jnp.asarray(v) for k, v in built.rows(np.array([0]), seq).items()}
    losses = jax.jit(dflash.draft_losses, static_argnames=("cfg", "dcfg", "gamma"))
    live = losses(tree, params, cfg, dcfg, window, anchors, 4.0)[1]
    cached = losses(tree, params, cfg, dcfg, window, anchors, 4.0, rows)[1]
    for key in ("loss", "level_loss", "level_agreement"):
        np.testing.assert_allclose(np.asarray(cached[key]), np.asarray(live[key]), rtol=2e-4, err_msg=key)


def test_segments_and_batches(scripts):
    cache = scripts[2]
    assert cache.segments(10, np.array([4, 7]), 100) == [(0, 4), (4, 7), (7, 10)]
    assert cache.segments(10, None, 4) == [(0, 4), (4, 8), (8, 10)]
    assert cache.segments(10, np.array([0, 3, 10]), 2) == [(0, 2), (2, 3), (3, 5), (5, 7), (7, 9), (9, 10)]
    batches = cache.plan_batches([(0, 5), (5, 40), (40, 41), (41, 50)], 8, 32, 16)
    assert [(b["length"], b["rows"], b["pieces"]) for b in batches] == [
        (32, 1, [(5, 40)]),  # 35 tokens, cut to max_len by the padding only (segments cut first)
        (16, 1, [(41, 50)]),
        (8, 2, [(0, 5), (40, 41)]),
    ]


def test_a_killed_build_resumes_to_the_same_bytes_and_another_cache_is_refused(scripts, llama, tmp_path):
    cache = scripts[2]
    _, cfg, params = llama
    stream = np.random.default_rng(2).integers(0, cfg.vocab_size, 150).astype(np.int32)
    starts = np.array([20, 50, 90, 100])
    kw = dict(starts=starts, k=4, max_len=64, bucket=16, token_budget=64)
    feats = lambda h: h.layers[0]  # noqa: E731
    whole = build_for(cache, tmp_path / "whole", cfg, params, (1,), feats, stream, **kw)
    assert build_for(cache, tmp_path / "cut", cfg, params, (1,), feats, stream, stop_after=1, **kw) is None
    with open(tmp_path / "cut" / "progress.json") as f:
        assert json.load(f) == {"batches_done": 1}
    resumed = build_for(cache, tmp_path / "cut", cfg, params, (1,), feats, stream, **kw)
    for name in ("features.npy", "top_ids.npy", "top_logp.npy"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()
    assert resumed.features.dtype.name == "bfloat16" and whole.top_ids.shape == (150, 4)
    # the top ids are the target's most likely next tokens, most likely first
    assert np.all(np.diff(np.asarray(whole.top_logp), axis=-1) <= 0)
    with pytest.raises(SystemExit, match=r"k: cache has 4, this run needs 8"):
        build_for(cache, tmp_path / "whole", cfg, params, (1,), feats, stream, **{**kw, "k": 8})
    with pytest.raises(SystemExit, match=r"data: cache has"):
        build_for(cache, tmp_path / "whole", cfg, params, (1,), feats, stream[::-1].copy(), **kw)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(SystemExit, match="is not a target cache"):
        build_for(cache, tmp_path / "junk", cfg, params, (1,), feats, stream, **kw)
    with pytest.raises(ValueError, match="feature_dtype"):
        build_for(cache, tmp_path / "new", cfg, params, (1,), feats, stream, feature_dtype="fp8", **kw)


def test_a_cache_grows_when_conversations_are_added(scripts, llama, tmp_path):
    cache = scripts[2]
    _, cfg, params = llama
    stream = np.random.default_rng(3).integers(0, cfg.vocab_size, 150).astype(np.int32)
    starts = np.array([20, 50, 90, 100])
    kw = dict(k=4, max_len=64, bucket=16, token_budget=64)
    feats = lambda h: h.layers[0]  # noqa: E731

    def build(d, n, **more):
        cut = {**kw, **more, "starts": starts[starts < n]}
        return build_for(cache, tmp_path / d, cfg, params, (1,), feats, stream[:n], **cut)

    whole = build("whole", 150)
    # an unfinished cache does not grow
    assert build("small", 90, stop_after=1) is None
    with pytest.raises(SystemExit, match="holds the first 90 tokens of this data but is not finished"):
        build("small", 150)
    small = build("small", 90)
    kept = np.asarray(small.features).copy()
    with pytest.raises(SystemExit, match="data: cache has"):  # 90 is no conversation start there
        other = np.array([20, 50, 100])
        build_for(cache, tmp_path / "small", cfg, params, (1,), feats, stream, starts=other, **kw)
    with pytest.raises(SystemExit, match="k: cache has 4, this run needs 8"):
        build("small", 150, k=8)
    grown = build("small", 150, stop_after=1)  # growing, then killed
    assert grown is None
    with open(tmp_path / "small" / "progress.json") as f:
        assert json.load(f) == {"from": 90, "batches_done": 1}
    grown = build("small", 150)
    assert grown.meta == whole.meta and grown.features.shape == whole.features.shape
    assert np.array_equal(np.asarray(grown.features[:90]), kept)  # the rows it had are kept
    for name in ("features", "top_logp"):
        np.testing.assert_allclose(
            np.asarray(getattr(grown, name), np.float32),
            np.asarray(getattr(whole, name), np.float32),
            rtol=2e-2,
            atol=2e-2,
        )
    assert np.mean(np.asarray(grown.top_ids) == np.asarray(whole.top_ids)) > 0.99
    assert not [n for n in os.listdir(tmp_path / "small") if "grow" in n or "tmp" in n]


@pytest.mark.slow
def test_training_runs_from_a_target_cache(tmp_path):
    script = os.path.join(SCRIPTS, "train_eagle3.py")
    base = [
        sys.executable,
        script,
        "--target",
        LLAMA,
        "--preset",
        "smoke",
        "--steps",
        "2",
        "--save-every",
        "2",
    ]
    base += [  # three modules: a cache of 2,110 tokens (the smoke preset's eight: 18,735)
        "--max-files",
        "3",
        "--draft-vocab",
        "700",
        "--own-text",
        "0",
        "--acceptance-k",
        "--target-cache",
        str(tmp_path / "cache"),
    ]
    run = finish(
        subprocess.Popen(
            [*base, "--out", str(tmp_path / "a")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    )
    assert run.returncode == 0, run.stderr
    assert "target cache" in run.stderr and (tmp_path / "a" / "model.safetensors").is_file()
    with open(tmp_path / "cache" / "meta.json") as f:
        meta = json.load(f)
    assert meta["features"].startswith("EAGLE-3") and meta["k"] == 32 and meta["feature_dtype"] == "bfloat16"
    refused = finish(
        subprocess.Popen(
            [*base, "--out", str(tmp_path / "b"), "--cache-k", "8"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    assert refused.returncode != 0 and "k: cache has 32, this run needs 8" in refused.stderr
    own_text = [a for a in base if a not in ("--own-text", "0")]
    mixed = finish(
        subprocess.Popen(
            [*own_text, "--out", str(tmp_path / "d")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    assert mixed.returncode == 2 and "add --own-text 0" in mixed.stderr
