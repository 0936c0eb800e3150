"""Draft methods: what proposes the K tokens a speculative step verifies (:mod:`.base`)."""

from __future__ import annotations

from mtp_jax.drafts import dflash, eagle3, mtp
from mtp_jax.drafts.base import Draft, Rows

DRAFTS: dict[str, Draft] = {d.name: d for d in (mtp.DRAFT, eagle3.DRAFT, dflash.DRAFT)}
DRAFT_METHODS = tuple(DRAFTS)


def draft_for(name: str) -> Draft:
    """The registered draft method called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in DRAFTS:
        raise ValueError(f"unknown draft {name!r}; available: {', '.join(DRAFTS)}")
    return DRAFTS[name]


__all__ = ["DRAFTS", "DRAFT_METHODS", "Draft", "Rows", "draft_for"]
