"""The package layout: no import circles between modules, whether imports sit at module level or
inside functions (a function-level import that closes a circle is a circle all the same)."""

from __future__ import annotations

import ast
import os

from tests.conftest import REPO

PACKAGES = ("mtp_jax", "pallas_kernels")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module ``module`` imports, except under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_package else parts[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {}
    for package in PACKAGES:
        for root, _, names in os.walk(os.path.join(REPO, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    files[_module_name(path)] = path
    graph = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        is_package = path.endswith("__init__.py")
        # importing a.b.c runs a, a.b and a.b.c; an edge to each package on the way is implied,
        # but only the named module's own imports can close a circle back here
        graph[module] = {m for m in _imports(tree, module, is_package) if m in files and m != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_importing_the_kernels_first_works():
    """pallas_kernels uses mtp_jax's FP8 weight type; importing it before anything else must not
    trip over a half-initialised mtp_jax (the package's public names load lazily)."""
    import subprocess
    import sys

    for first in ("pallas_kernels.moe", "mtp_jax.moe", "mtp_jax.ep", "mtp_jax.cli", "mtp_jax.bench"):
        run = subprocess.run(
            [sys.executable, "-c", f"import {first}"], capture_output=True, text=True, cwd=REPO
        )
        assert run.returncode == 0, (first, run.stderr[-2000:])
