"""The package layout: no import circles between modules or between folders, whether imports sit at
module level or inside functions (a function-level import that closes a circle is a circle all the
same); imports run down the layers; the kernels and the checkpoint files import no model."""

from __future__ import annotations

import ast
import os

import pytest

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


def _folder(module: str) -> str:
    """The node a module stands for in the folder graph: its package folder (``mtp_jax.targets``,
    ``mtp_jax.targets.llama``, ``pallas_kernels.moe``), or itself for a module at a package's top
    level, whose folder is the whole package (a module there has one job, a folder a theme)."""
    parts = module.split(".")
    path = os.path.join(REPO, *parts)
    if os.path.isdir(path):  # a package: its folder
        return module
    return module if len(parts) == 2 else ".".join(parts[:-1])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder-level imports: an edge between two folders when a module of one imports a module of the
    other, a folder's own subfolders excepted (a package imports its parts)."""
    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        a = _folder(module)
        folders.setdefault(a, set())
        for other in imported:
            b = _folder(other)
            if b != a and not b.startswith(a + ".") and not a.startswith(b + "."):
                folders[a].add(b)
    for targets in list(folders.values()):
        for b in targets:
            folders.setdefault(b, set())
    return folders


def test_no_import_circles_between_folders():
    folders = folder_graph(import_graph())
    cycle = find_cycle(folders)
    assert cycle is None, " -> ".join(cycle)


def test_the_folder_graph_sees_a_folder_circle():
    graph = {"mtp_jax.targets.base": {"mtp_jax.drafts.base"}, "mtp_jax.drafts.base": {"mtp_jax.targets"}}
    assert find_cycle(folder_graph({**graph, "mtp_jax.targets": set()})) is not None


# The layers of the package, lowest first: a module may import its own layer and those below. Every
# module belongs to one (the longest matching prefix); a new module must be placed here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pallas_kernels",),  # kernels, the FP8 weight type they take, the paged-attention reference
    (
        "mtp_jax.errors",
        "mtp_jax.progress",
        "mtp_jax.sharding",
        "mtp_jax.cache",
        "mtp_jax.fp8",
        "mtp_jax.param_bytes",
        "mtp_jax.embedded",
        "mtp_jax.distributed",
        "mtp_jax.evalsets",
    ),
    (
        "mtp_jax.config",
        "mtp_jax.checkpoint",
        "mtp_jax.sampling",
        "mtp_jax.schedule",
        "mtp_jax.grammar",
        "mtp_jax.text",
        "mtp_jax.lora",
        "mtp_jax.layers",
        "mtp_jax.gqa",
    ),
    ("mtp_jax.targets",),
    ("mtp_jax.tree", "mtp_jax.drafts"),
    ("mtp_jax.step", "mtp_jax.autok", "mtp_jax.request", "mtp_jax.timing"),
    ("mtp_jax.scheduler", "mtp_jax.scoring", "mtp_jax.model", "mtp_jax.builtin"),
    ("mtp_jax.serving",),
    (  # tools and entry points
        "mtp_jax",
        "mtp_jax.server",
        "mtp_jax.plugins",
        "mtp_jax.estimate",
        "mtp_jax.synthetic",
        "mtp_jax.export",
        "mtp_jax.plan",
        "mtp_jax.bench",
        "mtp_jax.acceptance",
        "mtp_jax.roofline",
        "mtp_jax.cli",
        "mtp_jax.train",
    ),
)
MAX_UPWARD_IMPORTS = 2


def layer_of(module: str) -> int:
    best, level = "", None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    if level is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py's LAYERS: place it there")
    return level


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, imported in graph.items() for b in imported if layer_of(b) > layer_of(a))


def test_imports_run_down_the_layers():
    upward = upward_imports(import_graph())
    assert len(upward) <= MAX_UPWARD_IMPORTS, "imports that run up the layers:\n" + "\n".join(
        f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in upward
    )


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"mtp_jax.config": {"mtp_jax.step"}, "mtp_jax.step": {"mtp_jax.config"}}) == [
        ("mtp_jax.config", "mtp_jax.step")
    ]


def test_kernels_import_nothing_from_mtp_jax():
    graph = import_graph()
    wrong = sorted(
        (a, b)
        for a, imported in graph.items()
        for b in imported
        if a.startswith("pallas_kernels") and b.split(".")[0] == "mtp_jax"
    )
    assert not wrong, wrong


def test_checkpoint_imports_no_model():
    """``checkpoint/`` reads and writes files: no target, draft or tool above it."""
    graph = import_graph()
    wrong = sorted(
        (a, b)
        for a, imported in graph.items()
        for b in imported
        if a.startswith("mtp_jax.checkpoint") and layer_of(b) > layer_of("mtp_jax.checkpoint")
    )
    assert not wrong, wrong


@pytest.mark.spawns
def test_importing_any_module_first_works():
    """Importing the package registers the shipped models (:mod:`mtp_jax.builtin`); whichever module
    a program imports first, the package initialises without tripping over itself."""
    import subprocess
    import sys

    for first in (
        "pallas_kernels.moe",
        "mtp_jax.targets.deepseek_v3.moe",
        "mtp_jax.config",
        "mtp_jax.cli",
    ):
        code = f"import {first}; from mtp_jax.targets import TARGETS; assert len(TARGETS) >= 4"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
        assert run.returncode == 0, (first, run.stderr[-2000:])


# modules outside the model and draft folders that still import one, and why
NAMED_FROM_OUTSIDE = {
    "mtp_jax": "the public API re-exports DeepseekV3Config",
    "mtp_jax.bench": "the synthetic DeepSeek-V3 that mtp-jax bench times when given no model",
    "mtp_jax.builtin": "the registration of the shipped targets and drafts",
}


def _family(module: str) -> str | None:
    """The model or draft folder ``module`` belongs to (mtp_jax.targets.llama, ...), if any."""
    parts = module.split(".")
    if (
        len(parts) >= 3
        and parts[:2] in (["mtp_jax", "targets"], ["mtp_jax", "drafts"])
        and parts[2] not in ("base", "teacher")  # the seam and the teacher every draft trains on
    ):
        return ".".join(parts[:3])
    return None


def test_no_module_outside_a_model_or_draft_folder_imports_one():
    """A model or a draft lives in its folder: the core, the tools and the other folders reach it
    through the registries (a draft may build on a target's pieces: EAGLE-3 with MLA attention)."""
    graph = import_graph()
    wrong = sorted(
        (a, b)
        for a, imported in graph.items()
        for b in imported
        if _family(b) is not None and _family(a) is None and a not in NAMED_FROM_OUTSIDE
    )
    assert not wrong, "modules that import a model's or a draft's folder:\n" + "\n".join(
        f"{a} -> {b}" for a, b in wrong
    )
    for module in NAMED_FROM_OUTSIDE:
        assert any(_family(b) for b in graph[module]), f"{module} imports no model folder any more: drop it"


# comparisons with a model's or a draft's name outside its folder that stay, and why
NAME_COMPARED_OUTSIDE = {
    ("mtp_jax.estimate", "mtp"): "a hub tensor component (the target's own draft layers), not the draft",
}


def _compared_names(tree: ast.AST, names: set[str]) -> set[str]:
    """String constants among ``names`` that a comparison (==, !=, in) tests against."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found |= {x.value for x in items if isinstance(x, ast.Constant) and x.value in names}
    return found


def test_no_model_or_draft_name_is_compared_outside_its_folder():
    """The core branches on no model or draft: ``x == "eagle3"`` or ``arch in ("llama", ...)`` belong
    in that model's or draft's folder (registered names: every draft, every config model_type)."""
    import mtp_jax  # noqa: F401  (the shipped registrations)
    from mtp_jax.config import model_types
    from mtp_jax.drafts import DRAFTS

    names = set(DRAFTS) | set(model_types())
    wrong, seen = [], set()
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for file in files:
                path = os.path.join(root, file)
                module = _module_name(path)
                if not file.endswith(".py") or _family(module) or module == "mtp_jax.builtin":
                    continue
                with open(path, encoding="utf-8") as f:
                    for name in _compared_names(ast.parse(f.read()), names):
                        seen.add((module, name))
                        if (module, name) not in NAME_COMPARED_OUTSIDE:
                            wrong.append(f"{module} compares {name!r}")
    assert not wrong, "\n".join(sorted(wrong))
    assert set(NAME_COMPARED_OUTSIDE) <= seen, set(NAME_COMPARED_OUTSIDE) - seen


def test_the_name_check_sees_a_comparison():
    tree = ast.parse("if draft == 'eagle3' or arch in ('llama', 'x'): pass")
    assert _compared_names(tree, {"eagle3", "llama", "ngram"}) == {"eagle3", "llama"}


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 80
# what is over those limits, at most this long: each entry may only shrink, then go (issue 61 emptied
# it: Engine and Scheduler were the last, split into serving/thread.py and the scheduler/ package)
OVERSIZE: dict[str, int] = {}


def oversized(tree: ast.AST, module: str) -> dict[str, int]:
    """Classes over MAX_CLASS_LINES and functions over MAX_FUNCTION_LINES lines, by qualified name."""
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                lines = child.end_lineno - child.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    out[name] = lines
                visit(child, name)

    visit(tree, module)
    return out


def test_classes_and_functions_stay_short():
    """No class over 300 lines and no function over 80 in mtp_jax (pallas_kernels excepted), but
    for today's list, whose entries may only shrink."""
    found = {}
    for root, _, files in os.walk(os.path.join(REPO, "mtp_jax")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(root, file)
                with open(path, encoding="utf-8") as f:
                    found |= oversized(ast.parse(f.read()), _module_name(path))
    new = {k: v for k, v in found.items() if k not in OVERSIZE}
    grown = {k: (v, OVERSIZE[k]) for k, v in found.items() if k in OVERSIZE and v > OVERSIZE[k]}
    assert not new, f"over {MAX_CLASS_LINES} lines (a class) or {MAX_FUNCTION_LINES} (a function): {new}"
    assert not grown, f"grew past their recorded size (now, recorded): {grown}"
    gone = set(OVERSIZE) - set(found)
    assert not gone, f"now within the limits: remove from OVERSIZE: {sorted(gone)}"


def test_the_size_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    assert oversized(ast.parse(f"def f():\n{body}\n"), "m") == {"m.f": 86}
