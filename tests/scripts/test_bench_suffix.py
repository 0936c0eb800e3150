"""scripts/bench_suffix.py: its workloads end to end on the embedded model, small (the outputs of
every method checked equal to plain decoding's by the script itself)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO
from tests.scripts.test_train_tiny import import_script


@pytest.mark.slow
def test_the_workloads_run_and_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "suffix.json"
    argv = ["bench_suffix.py", "--workload", "rollout", "code-edit", "mix", "--batch", "1"]
    argv += [
        "--prompts",
        "2",
        "--samples",
        "2",
        "--conversations",
        "2",
        "--turns",
        "2",
        "--chat-prompts",
        "1",
    ]
    argv += [
        "--new-tokens",
        "8",
        "--warm-tokens",
        "4",
        "--max-len",
        "512",
        "--methods",
        "suffix",
        "suffix widths",
    ]
    argv += ["--widths", "2", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    assert import_script(os.path.join(REPO, "scripts", "bench_suffix.py")).main() == 0
    report = json.loads(out.read_text())
    rows = {(r["workload"], r["method"]): r for r in report["rows"]}
    methods = ("plain", "suffix", "suffix widths")
    assert set(rows) == {(w, m) for w in ("rollout", "code-edit", "mix") for m in methods}
    assert set(rows["rollout", "suffix"]["steps_per_width"]) <= {"1", "9"}  # K = 8
    assert (
        sum(rows["rollout", "suffix widths"]["steps_per_width"].values())
        == rows["rollout", "suffix widths"]["steps"]
    )
    assert rows["rollout", "suffix widths"]["ms_per_step"] > 0
    assert rows["rollout", "plain"]["tokens"] == 2 * 2 * 8 and rows["mix", "suffix"]["tokens"] == 5 * 8
    assert rows["rollout", "suffix"]["draft_learned"]["outputs"] == 4  # the index counted each sample
    assert rows["rollout", "plain"]["vs_plain"] == 1.0
    sources = rows["rollout", "suffix"]["drafts_by_source"]  # the samples after the first: the index
    assert set(sources) <= {"text", "index", "none"} and sources["none"]["drafts"] == 0, sources
    assert rows["rollout", "plain"]["drafts_by_source"] is None
    assert "suffix" in capsys.readouterr().err


def test_widths_add_each_suffix_method_with_the_draft_option():
    import argparse

    script = import_script(os.path.join(REPO, "scripts", "bench_suffix.py"))
    args = argparse.Namespace(k=8, draft_model="d", neural="eagle3", neural_k=3, tree=None, widths=[2, 3])
    chosen = script.methods(args)
    assert chosen["suffix widths"] == {
        "draft": "suffix",
        "num_speculative_tokens": 8,
        "draft_options": {"widths": [2, 3]},
    }
    assert chosen["suffix_eagle3 widths"]["draft_options"] == {"widths": [2, 3]}
    assert "eagle3 widths" not in chosen and "ngram widths" not in chosen
