"""Where the suite's time goes: ``MTP_JAX_TESTS_TIMELINE=FILE python -m pytest`` appends one JSON line
per test (the main process and the second lane's worker: tests/background.py), per child check
(its process's wall time) and per lane, with each test's XLA compile seconds and persistent-cache
hits and misses; at the end the main process prints each lane's span and busy time.

Read it to balance the lanes (conftest's ``SECOND_LANE_MODULES``) and to find the tests that
compile most. The listeners are registered after conftest has set up JAX's compilation cache: a
plugin that imports JAX before conftest does (``-p`` runs first) leaves the cache off for the whole
run, which by itself made a full run ~6 minutes slower.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest

ENV = "MTP_JAX_TESTS_TIMELINE"
_COMPILE = "/jax/core/compile/backend_compile_duration"  # also fires on a cache hit (its read time)
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class Timeline:
    """Appends records to the file named by ``$MTP_JAX_TESTS_TIMELINE`` (one line each, so that
    processes can share it)."""

    def __init__(self, path: str, lane: str) -> None:
        self.path, self.lane = path, lane
        self.lock = threading.Lock()  # the lane's thread writes child checks beside the tests

    @classmethod
    def from_env(cls, lane: str) -> Timeline | None:
        path = os.environ.get(ENV)
        return cls(path, lane) if path else None

    def write(self, kind: str, name: str, t0: float, t1: float, **extra) -> None:
        line = json.dumps({"lane": self.lane, "kind": kind, "name": name, "t0": t0, "t1": t1, **extra})
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


class TimelinePlugin:
    """Records each test run in this process (replayed tests are the worker's to record), with the
    backend compile seconds and cache hits and misses JAX reports while it runs. Made after conftest
    has set up JAX's compilation cache (see the module's docstring)."""

    def __init__(self, timeline: Timeline, replayed) -> None:
        import jax.monitoring as monitoring

        self.timeline, self.replayed = timeline, replayed
        self.started = time.time()
        self.counts: collections.Counter = collections.Counter()
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event == _COMPILE:
            self.counts["compile_s"] += seconds

    def _event(self, event: str, **_) -> None:
        if event in (_HIT, _MISS):
            self.counts["hits" if event == _HIT else "misses"] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.replayed(item):
            yield
            return
        self.counts.clear()
        t0 = time.time()
        yield
        counts = {k: round(v, 3) for k, v in self.counts.items()}
        self.timeline.write("test", item.nodeid, t0, time.time(), **counts)

    def finish(self) -> None:
        """Records this process's span, collection to the session's end (called then): in the file
        only, since :func:`summary` counts work, not waiting."""
        self.timeline.write("lane", self.timeline.lane, self.started, time.time())


def summary(path: str) -> str:
    """Each lane's first start, last end (minutes from the earliest record) and busy minutes, and the
    compile minutes and cache hits / misses of its tests."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return "timeline: nothing recorded"
    origin = min(r["t0"] for r in records)
    lanes: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        if r["kind"] != "lane":
            lanes["children" if r["kind"] == "child" else r["lane"]].append(r)
    lines = [f"timeline ({path}): lane, first start, last end, busy (minutes), compile, cache hits/misses"]
    for lane, rs in sorted(lanes.items()):
        first, last = min(r["t0"] for r in rs) - origin, max(r["t1"] for r in rs) - origin
        busy = sum(r["t1"] - r["t0"] for r in rs)
        compile_s = sum(r.get("compile_s", 0.0) for r in rs)
        hits, misses = sum(r.get("hits", 0) for r in rs), sum(r.get("misses", 0) for r in rs)
        lines.append(
            f"  {lane:9s} {first / 60:6.1f} {last / 60:6.1f} {busy / 60:6.1f} "
            f"{compile_s / 60:6.1f} {hits}/{misses}"
        )
    return "\n".join(lines)
