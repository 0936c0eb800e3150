"""The suffix draft's settings (``SpeculativeConfig.draft_options`` / ``draft_options={...}``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from mtp_jax.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
    """How the suffix draft matches and how large a tree it proposes (static: part of the step's
    compiled shape).

    The paper's rules: the longest suffix of the text (at most ``max_match`` tokens, at least
    ``min_match``) that occurred before selects the continuations that followed it; a node's
    score is its empirical probability (the share of those continuations that pass through it);
    nodes under ``min_prob`` are not proposed, and a row proposes at most ``spec_factor`` x the
    match length nodes (a long match is trusted with a larger tree).
    """

    max_match: int = 12
    """Longest suffix matched against the row's own text (prompt and output)."""
    min_match: int = 2
    """Shortest suffix matched."""
    occurrences: int = 16
    """Latest occurrences of the matched suffix in the row's own text whose continuations are counted."""
    spec_factor: float = 1.0
    """Nodes proposed per matched token (the paper's max_spec_factor)."""
    spec_offset: float = 0.0
    """Nodes proposed beyond ``spec_factor`` x the match length (the paper's max_spec_offset)."""
    min_prob: float = 0.1
    """Least empirical probability of a proposed node (the paper's min_token_prob)."""
    index_slots: int = 4096
    """Entries of the engine-wide index of finished outputs on the device (a power of two; 0: off)."""
    index_match: int = 8
    """Longest context the engine-wide index is keyed by (at least ``min_match``)."""
    index_paths: int = 4
    """Continuations kept per context in the engine-wide index (the most frequent)."""
    index_outputs: int = 4096
    """Finished outputs the engine-wide index remembers (the oldest are forgotten first)."""
    index_seed: str | None = None
    """A JSON-lines file of earlier outputs the index starts from (``{"prompt": ids, "output": ids,
    "cache_salt": text}`` per line; ``cache_salt`` optional: the tenant they belong to)."""

    threshold: float = 1.0
    """With a neural draft beside it (``draft="suffix_eagle3"``, ...): a row drafts from the suffix
    tree when its score (the expected number of its drafts accepted) reaches this, else from the
    neural draft."""
    neural_k: int | None = None
    """With a neural draft beside it: the drafts it proposes per step (default: its own default K,
    at most the step's K; the suffix chain may be longer): its chained passes cost each step."""
    widths: tuple[int, ...] = ()
    """Verification widths (tokens per row, between 1 and K + 1) a step may run at besides 1 and
    K + 1: each is a branch of the step program (compiled once), and a step verifies at the
    narrowest that holds every active row's drafts. With a neural draft beside it, its K + 1 is
    always one (rows that draft from it propose that many)."""
    fallback: Any = None
    """The neural draft's config when it is the fallback of a hybrid (set by the draft, not an option)."""

    def __post_init__(self) -> None:
        widths = self.widths
        if not isinstance(widths, (list, tuple)) or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths
        ):
            raise InvalidRequestError(
                f"suffix draft option widths must be a list of positive integers, got {widths!r}"
            )
        object.__setattr__(self, "widths", tuple(sorted(set(widths))))  # hashable: part of the step
        ints = ("max_match", "min_match", "occurrences", "index_match", "index_paths", "index_outputs")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(
                    f"suffix draft option {name} must be a positive integer, got {value!r}"
                )
        nk = self.neural_k
        if nk is not None and (isinstance(nk, bool) or not isinstance(nk, int) or nk < 1):
            raise InvalidRequestError(f"suffix draft option neural_k must be a positive integer, got {nk!r}")
        slots = self.index_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0 or slots & (slots - 1):
            raise InvalidRequestError(
                f"suffix draft option index_slots must be 0 or a power of two, got {slots!r}"
            )
        if not self.min_match <= self.max_match:
            raise InvalidRequestError(
                f"suffix draft options need min_match <= max_match, got {self.min_match} > {self.max_match}"
            )
        if not self.min_match <= self.index_match:
            raise InvalidRequestError(
                "suffix draft options need min_match <= index_match, got "
                f"{self.min_match} > {self.index_match}"
            )
        for name in ("spec_factor", "spec_offset", "min_prob", "threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidRequestError(f"suffix draft option {name} must be a number >= 0, got {value!r}")
        if self.index_seed is not None and not (
            isinstance(self.index_seed, str) and os.path.isfile(self.index_seed)
        ):
            raise InvalidRequestError(
                f"suffix draft option index_seed must name a file, got {self.index_seed!r}"
            )
        if self.min_prob > 1:
            raise InvalidRequestError(f"suffix draft option min_prob is a probability, got {self.min_prob!r}")

    @property
    def indexed(self) -> bool:
        """Whether the engine-wide index of finished outputs is on."""
        return self.index_slots > 0


OPTIONS = tuple(f.name for f in dataclasses.fields(SuffixConfig) if f.name != "fallback")


def suffix_config(options: Mapping[str, Any]) -> SuffixConfig:
    """The settings ``options`` names (the rest at their defaults); InvalidRequestError naming an
    unknown one."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise InvalidRequestError(f"unknown suffix draft options {unknown}; it takes {list(OPTIONS)}")
    return SuffixConfig(**{name: value for name, value in options.items()})
