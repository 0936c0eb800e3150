"""Keeps the ``spawns`` marker true: a test that starts a child process or an HTTP server and is
not marked ``@pytest.mark.spawns`` (or ``child``, whose process the suite starts for it) fails,
naming what it started. ``-m "not spawns"`` then really leaves out every test that does.

What counts: any :class:`subprocess.Popen` (``subprocess.run`` too, and the launcher's children)
and any ``uvicorn.Server.run``, from the test's own code or from a fixture set up for it (a
module's server fixture counts against the first test that sets it up: mark the module). The
suite's own background processes (the second lane, on its thread) do not count."""

from __future__ import annotations

import subprocess
import threading

LANE_THREAD = "second-lane"  # tests/background.py's thread: the suite's processes, not a test's

_current: list[str | None] = [None]
_started: dict[str, list[str]] = {}


def _note(what: str) -> None:
    node = _current[0]
    if node is not None and threading.current_thread().name != LANE_THREAD:
        _started.setdefault(node, []).append(what)


def _describe(args) -> str:
    text = args if isinstance(args, str) else " ".join(str(a) for a in args)
    return text if len(text) <= 120 else text[:117] + "..."


def install() -> None:
    """Watch process and server starts from now on (once per process)."""
    if getattr(subprocess.Popen.__init__, "_watched", False):
        return
    popen_init = subprocess.Popen.__init__

    def init(self, args, *a, **k):
        _note(f"a process: {_describe(args)}")
        popen_init(self, args, *a, **k)

    init._watched = True
    subprocess.Popen.__init__ = init
    try:
        import uvicorn
    except ImportError:
        return
    run = uvicorn.Server.run

    def server_run(self, *a, **k):
        _note("an HTTP server (uvicorn)")
        return run(self, *a, **k)

    uvicorn.Server.run = server_run


def enter(nodeid: str) -> None:
    _current[0] = nodeid


def leave(item) -> str | None:
    """The failure message for ``item`` (its test just ended) when it started something unmarked."""
    _current[0] = None
    started = _started.pop(item.nodeid, [])
    if not started or item.get_closest_marker("spawns") or item.get_closest_marker("child"):
        return None
    return (
        f"{item.nodeid} started {len(started)} child process(es) or server(s) but is not marked "
        f"@pytest.mark.spawns (tests/spawns.py); the first: {started[0]}"
    )
