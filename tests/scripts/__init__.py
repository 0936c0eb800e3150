"""Tests of ``scripts/``: each runs its script as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def run_script(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python scripts/NAME ARGS`` with the repository importable; its output captured as text."""
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", name), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
        timeout=timeout,
    )
