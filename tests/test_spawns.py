"""The ``spawns`` marker's enforcement (tests/spawns.py) catches what it is named after."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests import spawns


class _Item:
    def __init__(self, nodeid: str, markers: tuple[str, ...] = ()) -> None:
        self.nodeid, self.markers = nodeid, markers

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


@pytest.mark.spawns
def test_an_unmarked_test_that_starts_a_process_is_named():
    for markers, fails in (((), True), (("spawns",), False), (("child",), False)):
        item = _Item(f"fake::test{markers}", markers)
        spawns.enter(item.nodeid)
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        problem = spawns.leave(item)
        assert (problem is not None) == fails, markers
        if fails:
            assert "not marked @pytest.mark.spawns" in problem and "-c pass" in problem
    item = _Item("fake::quiet")  # started nothing: nothing to say
    spawns.enter(item.nodeid)
    assert spawns.leave(item) is None


@pytest.mark.spawns
def test_a_server_counts_and_the_suites_own_lane_does_not(tmp_path):
    uvicorn = pytest.importorskip("uvicorn")  # the serve extra; CI installs it
    item = _Item("fake::server")
    spawns.enter(item.nodeid)
    server = uvicorn.Server(uvicorn.Config(lambda scope, receive, send: None, uds=str(tmp_path / "s")))
    server.should_exit = True  # run() returns at once; the call is what counts
    thread = threading.Thread(target=server.run)
    thread.start()
    thread.join(30)
    assert "an HTTP server" in (spawns.leave(item) or "")
    item = _Item("fake::lane")
    spawns.enter(item.nodeid)
    lane = threading.Thread(
        target=subprocess.run, args=([sys.executable, "-c", "pass"],), name=spawns.LANE_THREAD
    )
    lane.start()
    lane.join(60)
    assert spawns.leave(item) is None
