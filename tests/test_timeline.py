"""tests/timeline.py: the records of a run and the summary of its lanes."""

from __future__ import annotations

import json

from tests.timeline import Timeline, summary


def test_records_and_the_lanes_summary(tmp_path):
    path = str(tmp_path / "timeline.jsonl")
    main, worker = Timeline(path, "main"), Timeline(path, "worker")
    main.write("child", "tests/a.py::test_sharded", 100.0, 160.0)  # a child check, run from main
    main.write("test", "tests/b.py::test_one", 100.0, 130.0, compile_s=12.0, hits=1, misses=3)
    worker.write("test", "tests/c.py::test_two", 160.0, 220.0, compile_s=30.0, misses=2)
    main.write("test", "tests/b.py::test_three", 130.0, 190.0, compile_s=6.0, hits=2)
    main.write("lane", "main", 100.0, 230.0)  # lanes' own spans are not work
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert [r["lane"] for r in records] == ["main", "main", "worker", "main", "main"]
    assert records[1] == {
        "lane": "main", "kind": "test", "name": "tests/b.py::test_one", "t0": 100.0, "t1": 130.0,
        "compile_s": 12.0, "hits": 1, "misses": 3,
    }  # fmt: skip
    lines = summary(path).splitlines()[1:]
    assert [line.split() for line in lines] == [
        ["children", "0.0", "1.0", "1.0", "0.0", "0/0"],
        ["main", "0.0", "1.5", "1.5", "0.3", "3/3"],
        ["worker", "1.0", "2.0", "1.0", "0.5", "0/2"],
    ]


def test_an_empty_timeline(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text("")
    assert summary(str(path)) == "timeline: nothing recorded"


def test_the_runs_compilation_cache_is_on():
    """conftest points JAX's persistent cache at the run's directory before JAX starts; a plugin that
    imported JAX first (``-p`` loads before conftest) would leave it off for the whole run, silently
    (a full run ~6 minutes slower). tests/timeline.py and tests/compile_counts.py import it later."""
    import os

    import jax

    assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0


def test_the_worker_compiles_at_level_2_only_the_tests_marked_optimized(monkeypatch):
    """The second lane's worker starts with JAX's "disable most optimizations" on (XLA's level 0
    whatever its flags say) and turns it off for a test marked ``optimized``, dropping compiled
    programs where the level changes; anywhere else nothing changes."""
    import jax
    from jax._src import compiler

    from tests import conftest
    from tests.background import WORKER_ENV

    before = compiler._DISABLE_MOST_OPTIMIZATIONS.value
    assert not conftest.set_optimisation_level(True)  # the main process: flags decide
    monkeypatch.setenv(WORKER_ENV, "1")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    monkeypatch.setattr(conftest, "_LEVEL_ZERO", [True])
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    try:
        jax.config.update("jax_disable_most_optimizations", True)
        assert not conftest.set_optimisation_level(False) and compiler._DISABLE_MOST_OPTIMIZATIONS.value
        assert conftest.set_optimisation_level(True) and not compiler._DISABLE_MOST_OPTIMIZATIONS.value
        assert not conftest.set_optimisation_level(True) and len(cleared) == 1
        assert conftest.set_optimisation_level(False) and compiler._DISABLE_MOST_OPTIMIZATIONS.value
        assert len(cleared) == 2
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
