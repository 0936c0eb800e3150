"""scripts/bench_compile.py: a smoke run on the embedded model, plain decoding only."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.spawns  # the scripts run as processes


def test_smoke_run_times_every_phase_of_both_programs(tmp_path):
    out = tmp_path / "compile.json"
    run = run_script("bench_compile.py", "--k", "0", "--batch", "1", "--repeat", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["program"], r["mode"]) for r in rows] == [
        ("prefill", "general"),
        ("step", "general"),
        ("prefill", "greedy-only"),
        ("step", "greedy-only"),
    ]
    for r in rows:
        assert r["k"] == 0 and r["trace"] > 0 and r["lower"] > 0 and r["compile"] > 0
        assert abs(r["total"] - (r["trace"] + r["lower"] + r["compile"])) < 1e-9
    assert "greedy-only / general, all programs:" in run.stdout


def test_bad_arguments_are_refused_by_name():
    run = run_script("bench_compile.py", "--repeat", "0", timeout=120)
    assert run.returncode == 2 and "--repeat" in run.stderr
