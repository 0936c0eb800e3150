"""The embedded default checkpoint is exactly what its committed script writes."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import EMBEDDED_MODEL, REPO


def test_script_reproduces_the_committed_checkpoint(tmp_path):
    out = tmp_path / "regen"
    subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "make_tiny_checkpoint.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    names = sorted(os.listdir(EMBEDDED_MODEL))
    assert names == sorted(os.listdir(out))
    for name in names:
        with open(os.path.join(EMBEDDED_MODEL, name), "rb") as a, open(out / name, "rb") as b:
            assert a.read() == b.read(), f"{name} differs from what scripts/make_tiny_checkpoint.py writes"
