"""Registering models defined outside the package: the calls the shipped ones use too
(:mod:`mtp_jax.builtin`). A target registers with :func:`register_target`, a draft with
:func:`register_draft`; each then runs everywhere a shipped one does."""

from __future__ import annotations

from mtp_jax.drafts import register_draft, unregister_draft
from mtp_jax.targets import register_target

__all__ = ["register_draft", "register_target", "unregister_draft"]
