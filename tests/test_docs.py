"""The documentation in docs/ is what the code points at: every `docs/<file>.md, "<heading>"` reference
in a docstring or comment names a file and a heading that exist, every relative Markdown link in
the README and docs/ resolves (its #anchor too), and nothing points at files outside the repository."""

from __future__ import annotations

import functools
import os
import re

from tests.conftest import REPO

REFERENCE = re.compile(r'docs/([\w-]+\.md),\s*"([^"]+)"')
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)]*)?\)")  # (target, #anchor); an empty target: this page


def sources() -> list[str]:
    out = []
    for top in ("mtp_jax", "scripts", "pallas_kernels", "tests"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return out


def headings(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.lstrip("#").strip() for line in f if line.startswith("#")]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_docs_reference_resolves():
    seen = 0
    for path in sources():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        outside = [name for name in ("DESIGN", "FORMATS") if f"{name}.md" in text and path != __file__]
        assert not outside, f"{path} points at {outside} (shared notes outside the repository)"
        for name, section in REFERENCE.findall(" ".join(text.split())):
            doc = os.path.join(REPO, "docs", name)
            assert os.path.isfile(doc), f"{path}: docs/{name} does not exist"
            assert any(h.startswith(section) for h in headings(doc)), f'{path}: no "{section}" in docs/{name}'
            seen += 1
    assert seen >= 8  # the formats and the step are referenced from the code


def test_markdown_links_resolve():
    pages = [os.path.join(REPO, "README.md")]
    pages += [
        os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md")
    ]
    anchors = functools.cache(lambda path: {slug(h) for h in headings(path)})
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target, anchor in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")) or not (target or anchor):
                continue
            where = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
            assert where.startswith(REPO + os.sep), f"{page} links outside the repository: {target}"
            assert os.path.exists(where), f"{page}: broken link {target}"
            if anchor and where.endswith(".md"):
                assert anchor[1:] in anchors(where), f"{page}: no heading for {target}{anchor} in {where}"
