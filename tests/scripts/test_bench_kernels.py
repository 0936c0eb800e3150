"""scripts/bench_kernels.py: a CPU smoke run on tiny shapes (the GPU numbers need a GPU)."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.spawns  # the scripts run as processes


def test_smoke_run_reports_bandwidth_and_skips_what_cannot_run(tmp_path):
    out = tmp_path / "kernels.json"
    args = [
        "--small",
        "--context",
        "64",
        "--iters",
        "2",
        "--copy-mb",
        "8",
        "--json",
        str(out),
        "--device-time",
    ]
    args += ["--gmm-weights", "bf16", "fp8", "--ops", "mla_decode", "gmm", "dense", "--dense-tokens", "2"]
    args += [
        "--impls",
        "kernel",
        "kernel-shared",
        "triton",
        "reference",
        "ragged_dot",
        "materialize",
        "blocked",
    ]
    run = run_script("bench_kernels.py", *args, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["copy_bandwidth_gb_s"] > 0
    rows = {(r["op"], r["impl"]): r for r in report["results"] if r.get("weights") != "fp8"}
    assert set(rows) == {
        ("mla_decode", "kernel"),
        ("mla_decode", "kernel-shared"),
        ("gmm", "kernel"),
        ("gmm", "triton"),
        ("mla_decode", "reference"),
        ("gmm", "reference"),
        ("gmm", "ragged_dot"),
    }
    assert "skipped" in rows[("mla_decode", "kernel-shared")]  # the tiny widths do not split in two
    dense = {r["impl"]: r for r in report["results"] if r["op"] == "dense" and r["d"] == 64 and r["f"] == 32}
    assert set(dense) == {"materialize", "blocked", "kernel"} and "skipped" in dense["kernel"]
    for impl in ("materialize", "blocked"):  # both against the float32 product of the dequantised weight
        assert dense[impl]["seconds"] > 0 and 0 < dense[impl]["rel_err"] < 1e-2
    for key in [("gmm", "kernel"), ("gmm", "triton")]:  # no GPU here: skipped with the reason, not faked
        assert "skipped" in rows[key] and "GPU" in rows[key]["skipped"]
    for key in [("mla_decode", "reference"), ("gmm", "reference"), ("gmm", "ragged_dot")]:
        assert rows[key]["seconds"] > 0 and rows[key]["gb_per_s"] > 0 and rows[key]["bytes"] > 0
        # --device-time: the operations' own time from a profiler trace, which the rates then use
        assert rows[key]["device_seconds"] > 0
        assert rows[key]["gb_per_s"] == pytest.approx(rows[key]["bytes"] / rows[key]["device_seconds"] / 1e9)
        # against the float32-accumulated baseline: bf16 output rounding only
        assert 0 < rows[key]["rel_err"] < 1e-2
    fp8 = [r for r in report["results"] if r.get("weights") == "fp8" and r["impl"] == "ragged_dot"]
    assert len(fp8) == 1 and fp8[0]["rel_err"] < 1e-2
    assert "| gmm weights=fp8 tokens=4 |" in run.stdout  # the markdown table, one line per case
