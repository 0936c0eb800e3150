"""The speculative-decoding evaluation prompts shipped as package data (README.md beside this file:
origin, licences), and a reader for them and for any user file in the same format.

The format is DeepSpec's ``eval_datasets/``: one JSON object a line, ``{"turns": ["first user
message", "second user message", ...]}``. Reading is strict (a malformed line is an error naming
the file and the line) because a silently skipped prompt would change every number measured on the
set, and a decontamination check that misses a prompt would let it leak into training.
"""

from __future__ import annotations

import json
import os

__all__ = ["DIRECTORY", "EvalSetError", "names", "path", "read", "read_all"]

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
"""Where the shipped ``*.jsonl`` files are."""


class EvalSetError(ValueError):
    """A prompt file that is not one ``{"turns": [str, ...]}`` object per line."""


def names() -> list[str]:
    """The shipped sets' names (file names without ``.jsonl``), sorted."""
    return sorted(f[: -len(".jsonl")] for f in os.listdir(DIRECTORY) if f.endswith(".jsonl"))


def path(name_or_path: str) -> str:
    """A shipped set's file (by name: "gsm8k") or the given path itself when it is a file."""
    if os.path.isfile(name_or_path):
        return name_or_path
    candidate = os.path.join(DIRECTORY, f"{name_or_path}.jsonl")
    if os.path.isfile(candidate):
        return candidate
    raise EvalSetError(
        f"no evaluation set {name_or_path!r}: neither a file nor one of the shipped sets {names()}"
    )


def read(name_or_path: str) -> list[list[str]]:
    """Every prompt of a set as its list of user turns (at least one non-empty-list of strings each).

    Blank lines are skipped; anything else that is not ``{"turns": [str, ...]}`` raises
    :class:`EvalSetError` naming the file and the 1-based line."""
    file = path(name_or_path)
    out: list[list[str]] = []
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{file}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalSetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise EvalSetError(
                    f'{where}: expected an object {{"turns": ["user message", ...]}} with at least one '
                    f"string turn, got {line.strip()[:80]!r}"
                )
            out.append(turns)
    return out


def read_all(names_or_paths: list[str] | None = None) -> dict[str, list[list[str]]]:
    """Several sets by name or path (default: every shipped set), keyed as given."""
    return {n: read(n) for n in (names() if names_or_paths is None else names_or_paths)}
