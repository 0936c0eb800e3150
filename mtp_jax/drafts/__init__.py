"""Draft methods: what proposes the K tokens a speculative step verifies (:mod:`.base`).

Each draft's folder builds one :class:`Draft`; :func:`register_draft` makes it known by name to the
step, ``generate``, the engine and server, the CLI and ``mtp-jax bench``. The registry starts
empty: the shipped drafts register in :mod:`mtp_jax.builtin`, one line each, and a draft defined
elsewhere (a plug-in) registers the same way before it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtp_jax.drafts.base import Draft, DraftContext, Rows
from mtp_jax.errors import ConfigError
from mtp_jax.sharding import register_group_layout

DRAFTS: dict[str, Draft] = {}
"""The registered draft methods by name (read it live: plug-ins add to it)."""


def register_draft(draft: Draft, *, replace: bool = False) -> Draft:
    """Make ``draft`` known by its name. A second draft of a taken name is refused unless
    ``replace`` (ValueError), as are names the command line reserves (auto, none)."""
    if not isinstance(draft, Draft):
        raise TypeError(f"register_draft takes a mtp_jax.drafts.Draft, got {type(draft).__name__}")
    if draft.name in ("auto", "none") or not draft.name.isidentifier():
        raise ValueError(f"{draft.name!r} cannot name a draft (a Python identifier other than auto and none)")
    if draft.name in DRAFTS and not replace and DRAFTS[draft.name] is not draft:
        raise ValueError(f"a draft named {draft.name!r} is already registered (pass replace=True)")
    DRAFTS[draft.name] = draft
    if draft.params_group is not None and draft.param_logical is not None:
        register_group_layout(draft.params_group, draft.param_logical)
    return draft


def unregister_draft(name: str) -> None:
    """Forget the draft called ``name`` (KeyError when none is)."""
    del DRAFTS[name]


def draft_for_config(draft_cfg: object) -> Draft:
    """The registered draft of a separately loaded draft's parsed config (its ``config_class``)."""
    for draft in DRAFTS.values():
        if draft.config_class is not None and isinstance(draft_cfg, draft.config_class):
            return draft
    raise TypeError(f"no registered draft takes a config of type {type(draft_cfg).__name__}")


def parse_draft_config(
    raw: Mapping[str, Any],
    num_target_layers: int,
    layer_ids: str = "inputs",
    target_vocab_size: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """A separately trained draft's config.json read alone (no tensors), by the first registered
    draft whose :attr:`~Draft.parse_config` hook takes it (the shipped ones: DFlash by its
    architecture or ``dflash_config``; a draft model when it is a plain causal LM a target reads,
    over ``target_vocab_size``, default its own; else EAGLE-3), with the target layers it captures
    resolved for a target of ``num_target_layers`` layers (``options``: the drafts' load options;
    ``layer_ids``, how EAGLE-3 ids are read, is its keyword form)."""
    options = {"layer_ids": layer_ids, **(options or {})}
    for draft in DRAFTS.values():
        if draft.parse_config is not None:
            cfg = draft.parse_config(raw, num_target_layers, options, target_vocab_size)
            if cfg is not None:
                return cfg
    kinds = ", ".join(d.title or d.name for d in DRAFTS.values() if d.parse_config is not None)
    raise ConfigError(f"not a draft config any registered draft reads ({kinds})")


def draft_methods() -> tuple[str, ...]:
    """The registered draft names, in registration order."""
    return tuple(DRAFTS)


def draft_for(name: str) -> Draft:
    """The registered draft method called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in DRAFTS:
        raise ValueError(f"unknown draft {name!r}; available: {', '.join(DRAFTS)}")
    return DRAFTS[name]


__all__ = [
    "DRAFTS",
    "Draft",
    "DraftContext",
    "Rows",
    "draft_for",
    "draft_for_config",
    "draft_methods",
    "parse_draft_config",
    "register_draft",
    "unregister_draft",
]
