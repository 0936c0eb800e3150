"""tests/background.py, the suite's second lane: a test it offloads to its background worker is
reported by the main process under its own name with the worker's outcome (passed, failed with the
worker's message, skipped), after the main process's own tests; a worker that dies takes down only
the tests it had not finished, each failed with its exit status and output."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.conftest import REPO

CONFTEST = """
import os

import pytest

from tests.background import SecondLane

LANE = SecondLane({repo!r}, "")


def pytest_configure(config):
    config.addinivalue_line("markers", "child(code): a child check")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    worker = bool(os.environ.get("MTP_JAX_TESTS_LANE_WORKER"))
    items[:] = LANE.start(items, set() if worker else {{"test_far.py"}}, config, background=not worker)


@pytest.fixture
def child_output(request):
    return LANE.child_output(request.node.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    return True if LANE.replay(item) else None


def pytest_sessionfinish(session):
    LANE.stop()
"""

FAR = """
import os

import pytest


def test_runs_in_the_worker():
    assert os.environ.get("MTP_JAX_TESTS_LANE_WORKER") == "1"


def test_fails():
    assert 1 == 2, "a failure far away"


def test_skips():
    pytest.skip("skipped far away")


@pytest.mark.child("import os; print('child of', os.environ.get('MTP_JAX_TESTS_LANE_WORKER'), 6 * 7)")
def test_child_check_far_away(child_output):
    assert child_output == "child of 1 42\\n"


@pytest.mark.parametrize("x", [1, 2])
def test_parametrized(x):
    print("printed far away", x)


def test_deselected():  # -k deselects it: the worker must not run it
    open(os.path.join(os.path.dirname(__file__), "deselected-ran"), "w").close()


def test_kills_the_worker():
    os._exit(3)


def test_after_the_worker_died():
    pass
"""

NEAR = """
import os

import pytest


def test_runs_here():
    assert "MTP_JAX_TESTS_LANE_WORKER" not in os.environ


@pytest.mark.child("import os; print('child of', os.environ.get('MTP_JAX_TESTS_LANE_WORKER'), 6 * 7)")
def test_child_check_here(child_output):
    assert child_output == "child of None 42\\n"
"""


@pytest.mark.spawns
def test_offloaded_tests_are_reported_in_the_main_process(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST.format(repo=REPO))
    (project / "test_far.py").write_text(FAR)
    (project / "test_near.py").write_text(NEAR)
    xml = tmp_path / "junit.xml"
    env = {"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        f"--rootdir={project}",
        f"--junitxml={xml}",
    ]
    run = subprocess.run(
        [*argv, "-v", "-k", "not deselected", str(project)],
        cwd=project,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert not (project / "deselected-ran").exists()

    order = re.findall(r"^(test_\S+) (?:PASSED|FAILED|SKIPPED|ERROR)", run.stdout, re.M)
    assert order[0] == "test_near.py::test_runs_here" and len(order) == 10, run.stdout  # the main's first

    cases = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next(
            (child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed"
        )
        message = "".join(child.get("message", "") + (child.text or "") for child in case)
        cases[case.get("name")] = (outcome, message)
    assert cases["test_runs_here"][0] == "passed"
    assert cases["test_runs_in_the_worker"][0] == "passed"
    assert cases["test_child_check_here"][0] == cases["test_child_check_far_away"][0] == "passed"
    assert cases["test_parametrized[1]"][0] == cases["test_parametrized[2]"][0] == "passed"
    assert cases["test_fails"][0] == "failure" and "a failure far away" in cases["test_fails"][1]
    assert (
        cases["test_skips"] == ("skipped", cases["test_skips"][1])
        and "skipped far away" in cases["test_skips"][1]
    )
    for name, outcome in (("test_kills_the_worker", "failure"), ("test_after_the_worker_died", "error")):
        assert cases[name][0] == outcome and "exited with 3" in cases[name][1], (name, cases[name])
    assert len(cases) == 10
