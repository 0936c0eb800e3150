"""docs/extending.md's walkthroughs, run exactly as written, outside the package: every ``# file:``
block saved under its path in a temporary directory, every ``# run`` block run there with that
directory on PYTHONPATH. A walkthrough that no longer works fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

DOC = os.path.join(REPO, "docs", "extending.md")
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def walkthroughs() -> dict[str, list[str]]:
    """The Python blocks of each ``## `` section of the document, in order."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    sections = {}
    for part in text.split("\n## ")[1:]:
        title, _, body = part.partition("\n")
        sections[title.strip()] = BLOCK.findall(body)
    return sections


def test_the_document_has_both_walkthroughs():
    sections = walkthroughs()
    assert set(sections) == {"Add a target", "Add a draft"}
    for blocks in sections.values():
        assert any(b.startswith("# run") for b in blocks) and any(b.startswith("# file: ") for b in blocks)


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.parametrize("section", ["Add a target", "Add a draft"])
def test_walkthrough_runs_as_written(section, tmp_path):
    runs = []
    for block in walkthroughs()[section]:
        first, _, code = block.partition("\n")
        if first.startswith("# file: "):
            path = tmp_path / first[len("# file: ") :].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code, encoding="utf-8")
        else:
            assert first.strip() == "# run", f"a block must start with '# file: PATH' or '# run': {first!r}"
            runs.append(code)
    assert runs
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MTP_JAX_REPO": REPO}
    for code in runs:
        # outside the repository: the package comes from the installed mtp_jax, the plug-in from tmp_path
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip(), "the walkthrough printed nothing"
