"""``mtp-jax plan``: abstract parameters equal to what the loader builds, and the step compiled on 8
simulated CPU devices with a per-device memory report.

Simulated devices need XLA_FLAGS before JAX starts, so the multi-device checks run in a child
process (as in tests/test_ep.py); the CLI sets the flag itself, or re-runs itself when JAX already
runs with too few devices.
"""

from __future__ import annotations

import json
import math
import os
import textwrap

import pytest

from mtp_jax import cli
from mtp_jax.plan import with_device_count
from tests.checkpoint.test_fp8 import fp8_config  # the tiny config with 16x8 FP8 blocks
from tests.conftest import REPO

# The loader (weights="fp8" and dense) against abstract_params on a data=2 x expert=4 mesh, then
# plan() with the step and prefill. Prints the report as JSON for the parent to check.
CHILD = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp

    import mtp_jax
    from mtp_jax.estimate import per_device_memory
    from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.synthetic import quantize_fp8
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from mtp_jax.plan import abstract_params, plan, shard_bytes
    from mtp_jax.sharding import make_mesh

    tmp = tempfile.TemporaryDirectory()  # removed when the child exits
    raw, path = json.loads(sys.argv[1]), os.path.join(tmp.name, "ckpt")
    cfg = DeepseekV3Config.from_dict(raw)
    block = tuple(raw["quantization_config"]["weight_block_size"])
    tensors = hub_tensors(cfg, seed=1)
    hub = quantize_fp8(tensors, block)  # kv_a_proj_with_mqa in FP8 too, as DeepSeek-V3 stores it
    write_hub_checkpoint(path, raw, hub)

    mesh = make_mesh(2, 4)
    for loaded, planned in (("fp8", "fp8"), ("dense", "bf16")):
        real = mtp_jax.load(path, "bfloat16", weights=loaded, mesh=mesh).params
        abstract = abstract_params(cfg, mesh, jnp.bfloat16, weights=planned)
        assert jax.tree.structure(real) == jax.tree.structure(abstract), loaded
        for (where, r), a in zip(jax.tree_util.tree_flatten_with_path(real)[0], jax.tree.leaves(abstract)):
            assert (r.shape, r.dtype) == (a.shape, a.dtype), (where, r.shape, r.dtype, a.shape, a.dtype)
            assert r.sharding.is_equivalent_to(a.sharding, r.ndim), (where, r.sharding, a.sharding)

    report = plan(
        cfg, {"data": 2, "expert": 4}, batch=8, max_len=40, page_size=4, k=2, prefill_len=16
    )
    # the routed experts unsharded, to compare with one device's share
    full = abstract_params(cfg, make_mesh(1, 1, devices=jax.devices()[:1]), jnp.bfloat16)
    routed = [full["moe"]["mlp"][n] for n in ("gate", "up", "down")] + [
        full["mtp"]["layer"]["mlp"][n] for n in ("gate", "up", "down")
    ]
    out = report.to_json()
    out["routed_total_bytes"] = shard_bytes(routed)
    out["estimate"] = per_device_memory(cfg, "fp8", {"data": 2, "expert": 4}, 0).expert_bytes
    print("PLAN-JSON " + json.dumps(out))
    """
)


@pytest.mark.child(CHILD, json.dumps(fp8_config()))
def test_abstract_params_match_the_loader_and_the_step_compiles(child_output):
    report = json.loads(child_output.split("PLAN-JSON ", 1)[1])
    assert report["mesh"] == {"data": 2, "expert": 4, "tensor": 1} and report["platform"] == "cpu"
    assert [c["name"] for c in report["compiled"]] == ["step", "prefill"]
    # one device holds a quarter of the routed experts (expert=4), as the analytic estimate says
    assert report["expert_bytes"] * 4 == report["routed_total_bytes"]
    assert report["expert_bytes"] == report["estimate"]
    # the analytic estimate (from config.json alone) is exactly what the loader holds per device
    assert report["weight_bytes"] == report["estimate_weight_bytes"]
    lay = report["layout"]
    assert lay["batch"] == 8 and lay["max_len"] == 40
    # data-parallel attention: the bf16 KV cache of every layer and the MTP layer split over all 8 devices
    cfg = fp8_config()
    page = lay["page_size"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    num_pages = lay["batch"] * math.ceil((lay["max_len"] + 2 * (lay["k"] + 1)) / lay["page_size"])
    total = num_pages * page * (cfg["num_hidden_layers"] + 1)
    assert report["cache_bytes"] * 8 == total
    for c in report["compiled"]:
        assert c["lower_seconds"] > 0 and c["compile_seconds"] > 0
        assert c["output_bytes"] > 0 and c["temp_bytes"] > 0
        # XLA's per-device arguments are exactly the parameter, cache and state shards computed
        # from the abstract shardings; the donated state is aliased to the outputs
        args = report["param_bytes"] + report["expert_bytes"] + report["cache_bytes"] + report["state_bytes"]
        if c["name"] == "step":
            assert c["argument_bytes"] == args
        assert c["argument_bytes"] >= args
        assert c["alias_bytes"] >= report["cache_bytes"] > 0
        assert c["peak_bytes"] > c["argument_bytes"]
    assert report["peak_bytes"] == max(c["peak_bytes"] for c in report["compiled"])


def _write_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fp8_config()))
    return str(path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mesh", "data=1,expert=3"], "does not divide n_routed_experts=8"),
        (["--mesh", "data=1,experts=8"], "unknown mesh axes ['experts']"),
        (["--mesh", "expert"], "--mesh must look like data=1,expert=8"),
        (["--mesh", "data=1,expert=8,tensor=2"], "'tensor'=2 is not supported yet"),
        (
            ["--mesh", "data=2,expert=4", "--batch", "3"],
            "batch 3 must be a multiple of data x expert = 8",
        ),
        (["-k", "17"], "k must be in [0, 16]"),
        (["--max-len", "8", "--prefill-len", "9"], "prefill_len must be in [0, max_len=8]"),
    ],
)
def test_bad_requests_are_refused_before_compiling(tmp_path, capsys, extra, message):
    assert cli.main(["plan", "--config", _write_config(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert "mtp-jax plan: error:" in err and message in err
    assert "re-running" not in err


def test_an_eagle3_draft_that_does_not_fit_is_refused_before_compiling(tmp_path, capsys):
    from tests.drafts.test_eagle3 import DRAFT_A  # 128 tokens; this target has 97

    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(DRAFT_A))
    assert cli.main(["plan", "--config", _write_config(tmp_path), "--draft-config", str(draft)]) == 2
    err = capsys.readouterr().err
    assert "the EAGLE-3 draft reads hidden states of width 32 over a vocabulary of 128" in err
    assert "re-running" not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["-k", "2"], "k > 0 needs a draft, but a Llama 3 checkpoint of this config has none of its own"),
        (["--draft", "mtp"], "the MTP draft is DeepSeek-V3's NextN layer; this model is Llama3Config"),
        (["--draft", "eagle3"], "draft 'eagle3' is a separately loaded draft: give its config"),
        (["--draft", "nope"], "unknown draft 'nope'"),
        (["--weights", "fp8"], "weights 'fp8': Llama 3 checkpoints are dense"),
    ],
)
def test_the_planned_draft_is_asked_of_the_registry(capsys, extra, message):
    """No draft named: the target's own (DeepSeek-V3's MTP layer; a Llama has none); a named one
    is asked whether it can draft for this model (its own reason when not)."""
    llama = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
    assert cli.main(["plan", llama, "--mesh", "data=1", "--batch", "2", "--max-len", "32", *extra]) == 2
    assert message in capsys.readouterr().err


def test_plan_needs_one_config(tmp_path, capsys):
    assert cli.main(["plan"]) == 2
    assert "give either a checkpoint directory or --config FILE" in capsys.readouterr().err


def test_device_count_flag_is_set_or_replaced():
    assert with_device_count("", 8) == "--xla_force_host_platform_device_count=8"
    flags = "--xla_foo=1 --xla_force_host_platform_device_count=2 --xla_bar"
    assert with_device_count(flags, 8) == "--xla_foo=1 --xla_bar --xla_force_host_platform_device_count=8"


@pytest.mark.spawns  # the CLI reruns itself in a child process
@pytest.mark.slow
def test_cli_reruns_itself_with_simulated_devices_and_prints_the_report(tmp_path, capfd):
    import jax

    assert len(jax.devices("cpu")) < 8  # this process's JAX runs: the CLI must re-run itself
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--config", _write_config(tmp_path), "--mesh", "data=1,expert=8", "--batch", "8"]
    argv += ["--max-len", "32", "--page-size", "4", "-k", "1", "--device-memory-gb", "1"]
    env = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + env if env else "")
    saved_flags = os.environ.get("XLA_FLAGS")
    try:
        assert cli.main([*argv, "--json", str(out_json)]) == 0
    finally:
        for name, value in (("PYTHONPATH", env), ("XLA_FLAGS", saved_flags)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    captured = capfd.readouterr()
    assert "re-running in a child process" in captured.err
    assert "step: compiled in" in captured.err
    out = captured.out
    assert "on mesh data=1 expert=8 tensor=1 (8 cpu devices), fp8 weights" in out
    assert "decode batch 8 rows x 32 tokens" in out and "MTP K=1" in out
    for line in ("routed experts", "KV cache (target + MTP)", "temporaries", "peak (args+out-alias+temp)"):
        assert line in out
    assert "Device memory 1 GB: fits" in out
    report = json.loads(out_json.read_text())
    assert report["mesh"]["expert"] == 8 and report["layout"]["k"] == 1


# Llama: the loader on a data=2 x tensor=4 mesh against abstract_params (structure, shapes, dtypes,
# shardings), then plan() of the step and prefill for that tiny model and of the step for the real
# Llama 3.1 8B config, whose per-device weights must be the analytic estimate.
LLAMA_CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp

    import mtp_jax
    from mtp_jax.estimate import per_device_memory
    from mtp_jax.config import load_config
    from mtp_jax.plan import abstract_params, plan
    from mtp_jax.sharding import make_mesh

    tiny, real_config = sys.argv[1], sys.argv[2]
    cfg = load_config(tiny)
    mesh = make_mesh(data=2, tensor=4)
    real = mtp_jax.load(tiny, "bfloat16", mesh=mesh).params
    abstract = abstract_params(cfg, mesh, jnp.bfloat16, weights="bf16")
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    for (where, r), a in zip(jax.tree_util.tree_flatten_with_path(real)[0], jax.tree.leaves(abstract)):
        assert (r.shape, r.dtype) == (a.shape, a.dtype), (where, r.shape, a.shape)
        assert r.sharding.is_equivalent_to(a.sharding, r.ndim), (where, r.sharding, a.sharding)
    out = {}
    options = dict(batch=4, max_len=40, page_size=4, k=0, weights="bf16", prefill_len=16)
    small = plan(cfg, {"data": 2, "tensor": 4}, **options)
    out["small"] = small.to_json()
    out["small_estimate"] = per_device_memory(cfg, "bf16", {"data": 2, "tensor": 4}, 0).weight_bytes
    big_cfg = load_config(real_config)
    big = plan(big_cfg, {"tensor": 8}, batch=8, max_len=4096, page_size=16, k=0, weights="bf16")
    out["big"] = big.to_json()
    print("PLAN-JSON " + json.dumps(out))
    """
)


@pytest.mark.child(
    LLAMA_CHILD,
    os.path.join(REPO, "tests", "fixtures", "parity_llama", "mha_fp16"),
    os.path.join(REPO, "configs", "llama-3.1-8b.json"),
)
def test_llama_abstract_params_match_the_loader_and_plans_compile(child_output):
    out = json.loads(child_output.split("PLAN-JSON ", 1)[1])
    small, big = out["small"], out["big"]
    assert small["mesh"] == {"data": 2, "expert": 1, "tensor": 4}
    assert [c["name"] for c in small["compiled"]] == ["step", "prefill"]
    assert small["weight_bytes"] == small["estimate_weight_bytes"] == out["small_estimate"]
    assert small["split_label"] == "tensor-split params"
    # 8 KV heads over tensor=4: each device holds a quarter of its data shard's cache
    lay = small["layout"]
    pages = lay["batch"] * math.ceil((lay["max_len"] + 2) / lay["page_size"])
    assert small["cache_bytes"] * 8 == pages * lay["page_size"] * 2 * 8 * 4 * 3 * 2  # K+V, 3 layers, bf16
    # Llama 3.1 8B on 8 devices: the analytic estimate, exactly; 1/8 of the split weights per device
    assert big["weight_bytes"] == big["estimate_weight_bytes"]
    assert 1.8e9 < big["expert_bytes"] < 1.95e9 and big["compiled"][0]["argument_bytes"] > big["weight_bytes"]
