"""scripts/bench_either.py: the n-gram step's width by lax.cond and by step.either, side by side."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.spawns  # the scripts run as processes


def test_times_both_forms_and_finds_the_copies_only_in_lax_cond(tmp_path):
    out = tmp_path / "either.json"
    args = [
        "--k",
        "2",
        "--context",
        "12",
        "--page-size",
        "4",
        "--rounds",
        "2",
        "--iters",
        "1",
        "--json",
        str(out),
    ]
    run = run_script("bench_either.py", *args, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {
        "plain",
        "no drafts, lax.cond",
        "no drafts, either",
        "drafts, lax.cond",
        "drafts, either",
    }
    assert all(len(r["rounds_ms"]) == 2 and r["median_ms"] > 0 for r in results.values())
    assert results["plain"]["paired_vs_plain"] == 1.0
    # the embedded model's latent pages, copied where a conditional's branch writes them (under the
    # tests' XLA flags one layer's pool keeps a copy in both forms here; under XLA's defaults, none)
    for drafts in ("drafts", "no drafts"):
        assert results[f"{drafts}, lax.cond"]["pool_copies"] > results[f"{drafts}, either"]["pool_copies"]
    assert "| drafts, either |" in run.stdout
