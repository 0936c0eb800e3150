"""scripts/profile_engine_step.py: an engine step's time by XLA operation, named from its HLO."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO
from tests.scripts import run_script

pytestmark = pytest.mark.spawns  # the script runs as a process


def test_profiles_the_steps_and_names_their_operations(tmp_path):
    out = tmp_path / "profile.json"
    model = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
    args = ["--model", model, "--slots", "2", "--max-len", "64", "--prompt-len", "20", "--new-tokens", "6"]
    run = run_script("profile_engine_step.py", *args, "--json", str(out), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] >= 5 and result["step_ms_median"] > 0 and result["step_op_ms"] > 0
    ops = [row["op"] for row in result["ops"]]
    # named by the JAX operation and its shape at the profiled 2 rows, not by XLA's fusion names
    assert any("dot_general" in op and "[2," in op for op in ops), ops
    assert not any(op.startswith(("ynn_fusion", "fusion")) for op in ops), ops
    assert "every first token after" in run.stdout
