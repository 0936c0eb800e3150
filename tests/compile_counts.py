"""A pytest plugin that counts the XLA programs each test compiles, by jitted function, with their
backend compile seconds: ``python -m pytest -p tests.compile_counts --compile-counts=FILE tests/...``
writes ``{test id: {function: [programs, seconds]}}`` as JSON and prints the ten costliest tests and
the run's split of JIT time. Two entries of each test are not functions: ``"(trace)"`` and
``"(lower)"`` hold [events, seconds] of tracing to jaxprs and lowering them to MLIR (JAX's own
duration events), the phases that come before each backend compile.

The suite's time is mostly compiling (docs/testing.md), and counts do not vary from run to run the way
seconds do on a shared 2-core machine: a change meant to shorten a test file shows in its counts of
``prefill`` and ``step`` programs (one per K, slot count, page-table width, admitted-row power of
two, prompt bucket, grammar masks and logprobs a test reaches)."""

from __future__ import annotations

import collections
import json
import logging
import os
import re

import pytest

_FINISHED = re.compile(r"Finished XLA compilation of jit\((.*?)\) in ([0-9.e+-]+) sec")
_PHASES = {  # JAX's event -> this plugin's entry
    "/jax/core/compile/jaxpr_trace_duration": "(trace)",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "(lower)",
}


def _programs(fns: dict) -> dict:
    """A test's entries that are compiled functions (its phase entries left out)."""
    return {fn: v for fn, v in fns.items() if fn not in _PHASES.values()}


class _Counts(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.test = "<collection>"
        self.counts: dict[str, dict[str, list]] = collections.defaultdict(
            lambda: collections.defaultdict(lambda: [0, 0.0])
        )

    def emit(self, record: logging.LogRecord) -> None:
        m = _FINISHED.match(record.getMessage())
        if m:
            entry = self.counts[self.test][m[1]]
            entry[0] += 1
            entry[1] += float(m[2])

    def duration(self, event: str, seconds: float, **_) -> None:
        phase = _PHASES.get(event)
        if phase is not None:
            entry = self.counts[self.test][phase]
            entry[0] += 1
            entry[1] += seconds


_HANDLER: _Counts | None = None


def pytest_addoption(parser) -> None:
    parser.addoption("--compile-counts", metavar="FILE", help="write each test's compiled programs to FILE")


def pytest_configure(config) -> None:
    global _HANDLER
    if config.getoption("compile_counts"):
        # JAX is imported here, after conftest has pointed its compilation cache at the run's
        # directory: a plugin (``-p`` comes first) importing it at its own import left the cache off
        import jax
        from jax._src import monitoring  # JAX's duration events (no public listener API)

        _HANDLER = _Counts()
        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(_HANDLER)  # the compile messages propagate up to it
        monitoring.register_event_duration_secs_listener(_HANDLER.duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _HANDLER is not None:
        _HANDLER.test = item.nodeid
    yield


def pytest_terminal_summary(terminalreporter, config) -> None:
    if _HANDLER is None:
        return
    path = config.getoption("compile_counts")
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:  # whole or not at all
        json.dump(_HANDLER.counts, f, indent=1)
    os.replace(f"{path}.tmp", path)
    costs = sorted(
        ((sum(s for _, s in fns.values()), test, fns) for test, fns in _HANDLER.counts.items()), reverse=True
    )
    terminalreporter.write_sep("-", f"compiled programs per test: trace + lower + compile (all in {path})")
    for seconds, test, fns in costs[:10]:
        n = sum(c for c, _ in _programs(fns).values())
        main = ", ".join(f"{fn} {fns[fn][0]}" for fn in ("prefill", "step") if fn in fns)
        terminalreporter.write_line(f"{seconds:6.1f} s {n:4d} programs ({main or 'no prefill/step'}) {test}")
    tests = _HANDLER.counts.values()
    totals = {
        "trace": sum(fns["(trace)"][1] for fns in tests if "(trace)" in fns),
        "lower": sum(fns["(lower)"][1] for fns in tests if "(lower)" in fns),
        "compile": sum(sec for fns in tests for _, sec in _programs(fns).values()),
    }
    terminalreporter.write_line("run: " + ", ".join(f"{k} {v:.1f} s" for k, v in totals.items()))
