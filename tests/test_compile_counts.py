"""tests/compile_counts.py, the plugin that counts each test's compiled programs: it still reads
JAX's compile log and duration events (a changed message or event name would silently count
nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.spawns
def test_counts_the_programs_a_test_compiles(tmp_path):
    out = tmp_path / "counts.json"
    test = "tests/test_config.py::test_config_works_as_a_jit_static_arg"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.compile_counts"]
    run = subprocess.run(
        [*argv, f"--compile-counts={out}", test], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    counts = json.loads(out.read_text())
    entries = counts[test]
    programs = {fn: v for fn, v in entries.items() if not fn.startswith("(")}
    assert sum(n for n, _ in programs.values()) >= 2 and all(s > 0 for _, s in programs.values()), programs
    for phase in ("(trace)", "(lower)"):  # JAX's duration events still arrive under these names
        assert entries[phase][0] >= 1 and entries[phase][1] > 0, entries
    assert "compiled programs per test" in run.stdout and test in run.stdout
    assert "run: trace " in run.stdout
