"""The documentation in docs/ is what the code points at: every `docs/<file>.md, "<heading>"` reference
in a docstring or comment names a file and a heading that exist, every relative Markdown link in
the README and docs/ resolves (its #anchor too), and nothing points at files outside the repository."""

from __future__ import annotations

import functools
import os
import re
import sys

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


def layout_listing(path: str) -> set[str]:
    """The module paths docs/architecture.md's Layout block names: a line ``name/`` opens a folder
    (its inline text lists modules in it as ``x.py``), a line ``x.py`` names a module of the folder
    above it, indentation says which."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = line.strip().split()[0]
        if indent >= 12 or not re.fullmatch(r"[\w.]+/?", entry):  # a description's continuation
            folder = stack[-1][1] if stack else ""
            listed.update(f"{folder}{name}" for name in re.findall(r"\b(\w+\.py)\b", line))
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        folder = stack[-1][1] if stack else ""
        if entry.endswith("/"):
            stack.append((indent, folder + entry))
            listed.add(f"{folder}{entry}__init__.py")
            inner = line.strip()[len(entry) :]
            listed.update(f"{folder}{entry}{name}" for name in re.findall(r"\b(\w+\.py)\b", inner))
        else:
            listed.add(folder + entry)
    return listed


def test_the_architecture_layout_lists_every_module():
    listed = layout_listing(os.path.join(REPO, "docs", "architecture.md"))
    modules = set()
    for top in ("mtp_jax", "pallas_kernels"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            modules.update(os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".py"))
    missing = sorted(m.replace(os.sep, "/") for m in modules if m.replace(os.sep, "/") not in listed)
    assert not missing, f"docs/architecture.md's Layout does not list: {missing}"
    stale = sorted(m for m in listed if m.endswith(".py") and not os.path.exists(os.path.join(REPO, m)))
    assert not stale, f"docs/architecture.md's Layout lists modules that do not exist: {stale}"


def test_the_architecture_picture_names_real_modules():
    """docs/architecture.dot (the source of docs/architecture.png) names modules that exist."""
    with open(os.path.join(REPO, "docs", "architecture.dot"), encoding="utf-8") as f:
        dot = "\n".join(line for line in f if not line.lstrip().startswith("//"))
    named = set(re.findall(r"\b([\w/]+\.py)\b", dot))
    assert named, "the picture names no module"
    missing = sorted(n for n in named if not os.path.exists(os.path.join(REPO, "mtp_jax", n)))
    assert not missing, missing


def test_the_architecture_picture_shows_every_target_and_draft():
    """The seam's boxes list every target and draft folder, and the PNG is drawn from this .dot."""
    import importlib.util

    with open(os.path.join(REPO, "docs", "architecture.dot"), encoding="utf-8") as f:
        dot = f.read()
    for family in ("targets", "drafts"):
        base = os.path.join(REPO, "mtp_jax", family)
        folders = [d for d in os.listdir(base) if os.path.exists(os.path.join(base, d, "__init__.py"))]
        assert folders
        missing = sorted(d for d in folders if f"{d}/" not in dot)
        assert not missing, f"docs/architecture.dot does not show {family} {missing}"
    spec = importlib.util.spec_from_file_location(
        "draw_architecture", os.path.join(REPO, "scripts", "draw_architecture.py")
    )
    draw = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("draw_architecture", draw)  # its dataclasses look their module up
    spec.loader.exec_module(draw)
    graph = draw.parse_dot()  # every node placed, every edge between nodes
    assert {"step", "targets", "drafts"} <= set(graph.nodes)
    assert draw.recorded_hash() == draw.source_hash(), (
        "docs/architecture.png is behind docs/architecture.dot: run python scripts/draw_architecture.py"
    )
