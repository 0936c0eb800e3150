"""The step's roofline: expected experts against sampled routing, the byte count against the
parameter counts of :mod:`mtp_jax.estimate` (written from the config, independently of
the parameter tree), random parameters against the loader's structure, and a CPU smoke run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import roofline
from mtp_jax.drafts import parse_draft_config
from mtp_jax.estimate import count_parameters, weight_bytes
from mtp_jax.plan import abstract_params
from mtp_jax.roofline import expected_experts, random_params, step_bytes
from mtp_jax.sharding import make_mesh
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from tests.conftest import REPO, TINY_CONFIG


@pytest.mark.parametrize("n_tokens, n_experts, top_k", [(1, 8, 2), (4, 8, 2), (12, 16, 4), (5, 256, 8)])
def test_expected_experts_matches_sampled_routing(n_tokens, n_experts, top_k):
    rng = np.random.default_rng(0)
    trials = 4000
    picks = np.argsort(rng.random((trials, n_tokens, n_experts)), axis=-1)[..., :top_k]
    touched = np.array([len(np.unique(p)) for p in picks])
    sem = touched.std() / np.sqrt(trials)
    assert abs(touched.mean() - expected_experts(n_tokens, n_experts, top_k)) < 4 * sem + 1e-9
    assert expected_experts(0, n_experts, top_k) == 0
    assert expected_experts(1, n_experts, top_k) == pytest.approx(top_k)


def test_expected_experts_rejects_bad_counts():
    with pytest.raises(ValueError, match="top_k"):
        expected_experts(3, 8, 9)
    with pytest.raises(ValueError, match="n_tokens"):
        expected_experts(-1, 8, 2)


def _touched(n: int, cfg) -> float:
    return expected_experts(n, cfg.n_routed_experts, cfg.num_experts_per_tok) / cfg.n_routed_experts


@pytest.mark.parametrize("k, batch, context", [(0, 1, 10), (3, 1, 100), (2, 4, 37)])
def test_step_bytes_of_the_loaded_model_match_the_parameter_count(tiny_model, k, batch, context):
    cfg = tiny_model.config
    pc = count_parameters(cfg)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    per_layer_experts = cfg.n_routed_experts * 3 * d * f  # gate, up, down of every routed expert
    n = batch * (k + 1)
    passes = [n] + [batch] * (k - 1) if k else []
    got = step_bytes(tiny_model.params, cfg, k=k, batch=batch, context=context, cache_itemsize=4)
    assert got.target_weights == pytest.approx(4 * (pc.main - pc.routed_experts - pc.embedding + n * d))
    assert got.target_experts == pytest.approx(4 * pc.routed_experts * _touched(n, cfg))
    assert got.draft_heads == pytest.approx(4 * k * d * cfg.vocab_size)
    mtp_rest = pc.mtp - per_layer_experts
    assert got.draft_weights == pytest.approx(4 * (k * mtp_rest + d * sum(passes)))
    assert got.draft_experts == pytest.approx(4 * per_layer_experts * sum(_touched(p, cfg) for p in passes))
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layers = cfg.num_hidden_layers + k
    assert got.kv == 4 * layers * batch * (context + k + 1) * width
    assert got.total == pytest.approx(sum(vars(got).values()))


def test_step_bytes_count_fp8_weights_with_their_scales(monkeypatch):
    """With every expert touched, a plain step reads the whole main model (FP8 weights, their block
    scales, the dense rest) except the embedding rows it does not look up: the estimate's bytes."""
    raw = dict(TINY_CONFIG, hidden_size=256, moe_intermediate_size=128, intermediate_size=384, vocab_size=300)
    cfg = DeepseekV3Config.from_dict(raw)
    no_mtp = DeepseekV3Config.from_dict(dict(raw, num_nextn_predict_layers=0))
    params = abstract_params(
        cfg, make_mesh(devices=jax.devices()[:1]), jnp.bfloat16, weights="fp8", mtp=False
    )
    monkeypatch.setattr(roofline, "expected_experts", lambda n, e, k: e)
    got = step_bytes(params, cfg, k=0, batch=2, context=5, cache_itemsize=2)
    held = sum(weight_bytes(no_mtp, "fp8").values())
    embed_rows = 2 * cfg.hidden_size * 2  # two tokens' rows, bfloat16
    assert got.target_weights + got.target_experts == held - 2 * cfg.vocab_size * cfg.hidden_size + embed_rows
    assert got.draft_weights == got.draft_experts == got.draft_heads == 0


def test_step_bytes_argument_errors(tiny_model):
    cfg = tiny_model.config
    with pytest.raises(ValueError, match="batch >= 1"):
        step_bytes(tiny_model.params, cfg, k=1, batch=0, context=4, cache_itemsize=4)
    no_mtp = {k: v for k, v in tiny_model.params.items() if k != "mtp"}
    with pytest.raises(ValueError, match="MTP layer"):
        step_bytes(no_mtp, cfg, k=1, batch=1, context=4, cache_itemsize=4)


@pytest.mark.parametrize("weights, planned", [("dense", "bf16"), ("fp8", "fp8")])
def test_random_params_have_the_loaders_structure(weights, planned):
    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    params = random_params(cfg, jnp.bfloat16, weights, seed=1)
    shapes = abstract_params(cfg, make_mesh(devices=jax.devices()[:1]), jnp.bfloat16, weights=planned)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shapes), strict=True):
        assert x.shape == s.shape and x.dtype == s.dtype
        assert np.isfinite(np.asarray(x, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(params["final_norm"], np.float32), 1.0)
    assert float(jnp.std(params["lm_head"].astype(jnp.float32))) == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match="weights"):
        random_params(cfg, jnp.bfloat16, "int4")


def test_random_params_with_a_draft_have_the_loaders_structure():
    """A DFlash draft's random weights sit where load(draft_model=) puts them, with no MTP layer."""
    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": cfg.hidden_size, "intermediate_size": 64}
    raw |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    raw |= {"vocab_size": cfg.vocab_size, "block_size": 4, "dflash_config": {"mask_token_id": 5}}
    draft_cfg = parse_draft_config(raw, cfg.num_hidden_layers)
    params = random_params(cfg, jnp.bfloat16, "dense", draft_cfg=draft_cfg)
    mesh = make_mesh(devices=jax.devices()[:1])
    shapes = abstract_params(cfg, mesh, jnp.bfloat16, weights="bf16", mtp=False, draft_cfg=draft_cfg)
    assert "mtp" not in params and "dflash" in params
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shapes), strict=True):
        assert x.shape == s.shape and x.dtype == s.dtype


def _run(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench_step.py"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
        cwd=cwd,
        timeout=600,
    )


@pytest.mark.spawns
def test_bench_step_smoke_run(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "step.json"
    args = ["--config", str(config), "--set", "num_hidden_layers=2", "--weights", "fp8", "--k", "0", "2"]
    args += ["--context", "40", "--page-size", "8", "--iters", "2", "--copy-mb", "8", "--json", str(out)]
    args += ["--profile", str(tmp_path / "profile")]
    run = _run(*args, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert min(report["copy_bandwidth_gb_s"], report["read_bandwidth_gb_s"]) > 0
    assert report["bandwidth_limit_gb_s"] == max(report["copy_bandwidth_gb_s"], report["read_bandwidth_gb_s"])
    assert report["dtype"] == "bfloat16"
    assert "num_hidden_layers=2" in report["model"]
    rows = {r["k"]: r for r in report["results"]}
    assert set(rows) == {0, 2}
    for r in rows.values():
        assert r["step_ms"] > 0 and r["bytes"] == pytest.approx(sum(r["bytes_by_part"].values()))
        assert r["dispatch_ms"] > 0  # the host's time per call, beside the step's
        assert r["over_roofline"] == pytest.approx(r["step_ms"] / r["roofline_ms"])
        assert r["roofline_ms"] == pytest.approx(r["bytes"] / report["bandwidth_limit_gb_s"] / 1e6)
    # two layers (one dense, one MoE) read the cache, plus the two MTP passes at K = 2
    width = TINY_CONFIG["kv_lora_rank"] + TINY_CONFIG["qk_rope_head_dim"]
    assert rows[2]["bytes_by_part"]["kv"] == (2 + 2) * (40 + 3) * width * 2
    assert rows[0]["bytes_by_part"]["draft_heads"] == 0 < rows[2]["bytes_by_part"]["draft_heads"]
    assert "| K | step ms |" in run.stdout
    # --profile: a trace per K, its costliest operations (XLA's on the CPU) listed per step
    for k, r in rows.items():
        assert (tmp_path / "profile" / f"k{k}").is_dir()
        ops = r["profile_top"]
        assert ops and all(op["us_per_step"] > 0 and op["calls_per_step"] > 0 for op in ops)
        assert [op["us_per_step"] for op in ops] == sorted((op["us_per_step"] for op in ops), reverse=True)
    assert "costliest operations per step" in run.stderr


def test_bench_step_with_a_random_eagle3_draft(tmp_path, capsys):
    """--draft-config: the shipped tiny EAGLE-3 draft's config over the tiny Llama's, random weights,
    the Llama's layers in buffers of their own (--layer-buffers on)."""
    out = tmp_path / "step.json"
    llama = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
    args = ["--config", os.path.join(llama, "config.json"), "--draft-config"]
    args += [
        os.path.join(llama + "-eagle3", "config.json"),
        "--draft-set",
        "draft_vocab_size=512",
        "--k",
        "2",
        "--layer-buffers",
        "on",
        "--logprobs",
        "--tree",
        "2,2,4,dynamic",
    ]
    args += ["--context", "40", "--page-size", "8", "--iters", "2", "--copy-mb", "8", "--json", str(out)]
    assert roofline.main(args, prog="scripts/bench_step.py") == 0  # in this process: the smoke run spawns
    printed = capsys.readouterr()
    stdout, stderr = printed.out, printed.err
    report = json.loads(out.read_text())
    assert "eagle3" in report["model"] and "draft_vocab_size=512" in report["model"]
    assert report["layer_buffers"] is True  # the unrolled layers over per-layer buffers ran
    row, tree = report["results"]
    # --tree: the step verifying a dynamic tree of 4 draft nodes, after the K rows
    assert (tree["k"], tree["tree"], tree["draft"]) == (4, "2,2,4,dynamic", "eagle3") and tree["step_ms"] > 0
    assert "| 4 (tree 2,2,4,dynamic) |" in stdout
    assert row["draft"] == "eagle3" and row["step_ms"] > 0 and row["bytes_by_part"]["draft_weights"] > 0
    # --logprobs: the step with log-probabilities timed beside the one without, alternately
    assert row["logprobs_step_ms"] > 0 and row["alternated_step_ms"] > 0
    assert "with log-probabilities" in stderr


def test_timed_steps_verify_their_drafts_where_a_lookup_proposes_per_row(tiny_model):
    """bench_step times an n-gram step as one whose lookup matched: each timed call starts from
    :func:`roofline.timed_call_state`, every row holding K drafts, so the step verifies them (here the
    target's own greedy tokens: all accepted, K + 1 emitted) instead of taking the branch of a step
    in which no row has a draft (one token per row, plain decoding's cost under the draft's name)."""
    from mtp_jax.step import StepConfig, init_state, step

    cfg, params = tiny_model.config, tiny_model.params
    k, batch, context, page = 3, 2, 12, 4
    width = -(-(context + 2 * (k + 1)) // page)

    def start(sc, drafts):
        state = init_state(sc, batch, batch * width, width, jnp.float32)
        return dataclasses.replace(
            state,
            page_table=jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width),
            next_token=jnp.asarray([5, 9], jnp.int32),
            drafts=drafts,
            active=jnp.ones((batch,), bool),
            seq_len=jnp.full((batch,), context, jnp.int32),
        )

    plain = StepConfig(cfg, page, 0)
    state, greedy = start(plain, jnp.zeros((batch, 0), jnp.int32)), []
    for _ in range(k):
        emitted, _, state, _ = step(params, state, plain)
        greedy.append(np.asarray(emitted[:, 0]))
    greedy = np.stack(greedy, axis=1)  # [batch, k]: what the target says after next_token

    sc = StepConfig(cfg, page, k, "ngram")
    for drafts_held, emits in ((0, 1), (k, k + 1)):
        state = roofline.timed_call_state(
            start(sc, jnp.asarray(greedy)),
            seq_len=jnp.full((batch,), context, jnp.int32),
            num_drafts=jnp.full((batch,), drafts_held, jnp.int32),
        )
        emitted, n_emit, _, _ = step(params, state, sc)
        assert np.asarray(n_emit).tolist() == [emits] * batch
        np.testing.assert_array_equal(np.asarray(emitted)[:, : min(emits, k)], greedy[:, : min(emits, k)])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "hidden_size=64"], "--set changes a --config"),
        (["--config", "CONFIG", "--set", "hidden_size"], "KEY=VALUE"),
        (["--config", "CONFIG", "--set", "hidden_size=sixty"], "is not JSON"),
        (["--k", "0", "--batch", "0"], "must be >= 1"),
        (["--context", "5000"], "max_position_embeddings"),
        (["--draft-config", "CONFIG"], "--draft-config goes with --config"),
        (["--config", "CONFIG", "--draft-set", "hidden_size=8"], "--draft-set changes a --draft-config"),
    ],
)
def test_bench_step_argument_errors(tmp_path, capsys, args, message):
    """Refused with exit status 2 and a message naming the problem (in this process: the script's
    own entry point is run by the smoke test above)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    argv = [str(config) if a == "CONFIG" else a for a in args]
    try:
        code = roofline.main(argv, prog="scripts/bench_step.py")
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_bench_step_times_a_sliding_window_ring(tmp_path, capsys):
    """--window-cache ring: a Gemma 3 config's step over its local layers' rings (random weights)."""
    config = os.path.join(
        REPO, "tests", "fixtures", "parity_gemma3", "mixed_softcap_linear_untied", "config.json"
    )
    out = tmp_path / "step.json"
    argv = [
        "--config",
        config,
        "--k",
        "0",
        "--context",
        "40",
        "--page-size",
        "4",
        "--iters",
        "1",
        "--copy-mb",
        "1",
    ]
    assert roofline.main([*argv, "--window-cache", "ring", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["window_cache"] == "ring" and report["results"][0]["step_ms"] > 0
    llama = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib", "config.json")
    assert roofline.main(["--config", llama, "--k", "0", "--iters", "1", "--window-cache", "ring"]) == 2
    assert "has no sliding-window layers" in capsys.readouterr().err
