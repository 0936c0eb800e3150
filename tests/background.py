"""The suite's second lane: work run in background processes beside the main pytest process, one
process at a time, so that both cores of a 2-core machine work (the main process compiles on one).

Two kinds of job, run in this order:
- child checks: a test marked ``@pytest.mark.child(CODE, *ARGS)`` (multi-device checks need
  XLA_FLAGS before JAX starts) gets ``python -c CODE ARGS`` run here; its ``child_output`` fixture
  waits for the output;
- offloaded modules (conftest's ``SECOND_LANE_MODULES``): their selected tests run in one ``python
  -m pytest`` worker (tests/lane_worker.py) while the main process runs the rest, and the main
  process replays the worker's reports in their place, so each test still passes, fails or skips
  under its own name in the run's output, ``--durations`` and ``--junitxml``. The worker runs the
  child checks of its tests itself, each when its test asks for it.
The JSON reports come through pytest's own (de)serialization hooks, the ones pytest-xdist uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from _pytest.reports import TestReport

CHILD_TIMEOUT = 600  # one child check
WORKER_TIMEOUT = 3600  # the offloaded modules together
WORKER_ENV = "MTP_JAX_TESTS_LANE_WORKER"  # set in the worker's environment


def in_worker() -> bool:
    """Whether this process is the second lane's worker (it offloads nothing and runs its child
    checks itself)."""
    return bool(os.environ.get(WORKER_ENV))


@dataclasses.dataclass
class _ChildJob:
    argv: list[str]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: subprocess.CompletedProcess | None = None


@dataclasses.dataclass
class _Offloaded:
    """One offloaded test: the worker's serialized reports for it (setup, call, teardown)."""

    reports: list[dict] = dataclasses.field(default_factory=list)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class SecondLane:
    def __init__(self, repo: str, xla_flags: str, worker_xla_flags: str | None = None) -> None:
        self.repo, self.xla_flags = repo, xla_flags
        self.worker_xla_flags = worker_xla_flags  # None: the worker inherits this process's XLA_FLAGS
        self.children: dict[str, _ChildJob] = {}
        self.offloaded: dict[str, _Offloaded] = {}
        self.worker_failure = ""  # the worker's exit and output tail, where it did not report a test
        self.current: subprocess.Popen | None = None
        self.stopping = False
        self.inline = False  # the worker's own lane: child checks run when their test asks
        self.timeline = None  # a tests.timeline.Timeline: each child check's wall time goes there

    # --- set up at collection's end ---------------------------------------------------------------
    def start(self, items: list, offload: set[str], config, background: bool = True) -> list:
        """Offload the tests of the modules in ``offload`` (paths relative to the rootdir) and queue
        the child checks of the others, run in the background, or with ``background`` False (the
        worker's own lane) when a test asks for its output; returns ``items`` reordered for this
        process, the offloaded tests last (where it waits for them)."""
        moved = [it for it in items if _module(it) in offload]
        if len(moved) == len(items):  # nothing would be left here: run it all in this process
            moved = []
        self.offloaded = {it.nodeid: _Offloaded() for it in moved}
        for item in items:
            marker = item.get_closest_marker("child")
            if marker is not None and item.nodeid not in self.offloaded:  # the worker runs its own
                self.children[item.nodeid] = _ChildJob([sys.executable, "-c", *map(str, marker.args)])
        self.inline = not background
        self.rootdir = str(config.rootpath)
        self.basetemp = os.path.join(config._tmp_path_factory.getbasetemp(), "second-lane")
        if (self.children and background) or self.offloaded:
            threading.Thread(target=self._run_all, name="second-lane", daemon=True).start()
        keep = [it for it in items if it.nodeid not in self.offloaded]
        return keep + moved

    def _child_env(self) -> dict:
        return dict(os.environ, PYTHONPATH=self.repo, XLA_FLAGS=self.xla_flags)  # children add their devices

    def _run_all(self) -> None:
        for nodeid, job in [] if self.inline else self.children.items():
            if self.stopping:
                job.result = subprocess.CompletedProcess(job.argv, -1, "", "the test session ended first")
            else:
                job.result = self._run_child(job.argv, self._child_env(), nodeid)
            job.done.set()
        if self.offloaded:
            try:
                self._run_worker()
            finally:
                for test in self.offloaded.values():
                    test.done.set()

    def _run_child(self, argv: list[str], env: dict, nodeid: str) -> subprocess.CompletedProcess:
        started = time.time()
        proc = self.current = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            out, err = proc.communicate(timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\nchild check timed out after {CHILD_TIMEOUT}s"
        finally:
            self.current = None
        if self.timeline is not None:
            self.timeline.write("child", nodeid, started, time.time())
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def _run_worker(self) -> None:
        if self.stopping:
            self.worker_failure = "the test session ended before the offloaded tests started"
            return
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.lane_worker", "-p", "no:cacheprovider"]
        env = dict(os.environ, PYTHONPATH=self.repo, **{WORKER_ENV: "1"})
        if self.worker_xla_flags is not None:
            # level 2 in its flags, but JAX's "disable most optimizations" (level 0, cheap LLVM
            # passes) for every test but those marked ``optimized`` (tests/conftest.py), and for
            # every process it starts
            env.update(XLA_FLAGS=self.worker_xla_flags, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
        with tempfile.TemporaryDirectory(prefix="mtp-jax-lane-") as tmp:
            report_path, log_path = os.path.join(tmp, "reports.jsonl"), os.path.join(tmp, "output.txt")
            open(report_path, "w").close()
            argv += [f"--lane-report={report_path}", f"--basetemp={self.basetemp}", *self.offloaded]
            with open(log_path, "w+", encoding="utf-8") as log, open(report_path, encoding="utf-8") as out:
                proc = self.current = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.rootdir, env=env
                )
                try:
                    self._follow(proc, out)
                finally:
                    self.current = None
                log.seek(0)
                tail = log.read()[-4000:]
        n = len(self.offloaded)
        self.worker_failure += f"the worker (pytest on {n} tests) exited with {proc.returncode}:\n{tail}"

    def _follow(self, proc: subprocess.Popen, reports) -> None:
        """Take the worker's reports as it writes them, until it exits (or is killed at the timeout)."""
        deadline = time.monotonic() + WORKER_TIMEOUT
        while proc.poll() is None:
            self._take(reports)
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                self.worker_failure = f"the offloaded tests timed out after {WORKER_TIMEOUT}s; "
            time.sleep(0.5)
        self._take(reports)

    def _take(self, reports) -> None:
        while True:
            at = reports.tell()
            line = reports.readline()
            if not line.endswith("\n"):  # none, or one the worker is still writing: read it whole later
                reports.seek(at)
                return
            data = json.loads(line)
            test = self.offloaded.get(data["nodeid"])
            if test is None:
                continue
            test.reports.append(data)
            if data["when"] == "teardown":
                test.done.set()

    def stop(self) -> None:
        self.stopping = True
        proc = self.current
        if proc is not None and proc.poll() is None:
            proc.kill()

    # --- used by the main process ---------------------------------------------------------------
    def child_output(self, nodeid: str) -> str:
        job = self.children.get(nodeid)
        if job is None:
            raise pytest.UsageError(f"{nodeid} uses child_output without a child marker")
        if self.inline and not job.done.is_set():
            job.result = self._run_child(job.argv, self._child_env(), nodeid)
            job.done.set()
        if not job.done.wait(timeout=CHILD_TIMEOUT * (len(self.children) + 1)):
            pytest.fail("the child check did not finish")
        result = job.result
        assert result.returncode == 0, f"child exited with {result.returncode}:\n{result.stderr[-4000:]}"
        return result.stdout

    def replay(self, item) -> bool:
        """Report offloaded ``item`` from the worker's reports (waiting for them); False where the
        item is not offloaded."""
        test = self.offloaded.get(item.nodeid)
        if test is None:
            return False
        hook = item.ihook
        hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        test.done.wait(timeout=WORKER_TIMEOUT + CHILD_TIMEOUT * (len(self.children) + 1))
        config = item.config
        reports = [config.hook.pytest_report_from_serializable(config=config, data=d) for d in test.reports]
        for report in reports:  # a skip's (path, line, reason) came back through JSON as a list
            if isinstance(report.longrepr, list):
                report.longrepr = tuple(report.longrepr)
        if not any(r.when == "teardown" for r in reports):  # the worker never finished this test
            why = f"second-lane worker: {self.worker_failure or 'the offloaded tests did not finish'}"
            when = "call" if any(r.when == "setup" for r in reports) else "setup"
            reports.append(TestReport(item.nodeid, item.location, {}, "failed", why, when))
            reports.append(TestReport(item.nodeid, item.location, {}, "passed", None, "teardown"))
        for report in reports:
            hook.pytest_runtest_logreport(report=report)
        hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]
