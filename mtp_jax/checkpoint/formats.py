"""Which key map reads a checkpoint: one module per model family (in its folder), chosen by the parsed config.

Each module provides ``param_groups(reader, cfg, dtype, *, weights, mtp, strict, skip, experts)``,
``export_tensors(params, cfg, dtype)`` (its inverse, for :mod:`mtp_jax.export`),
``group_sizes(cfg, mtp)``, ``assemble(groups, cfg, dtype, *, mtp, mesh)``, ``load_params(reader,
cfg, dtype, *, weights, mtp, strict, mesh)``, ``STACKED_GROUPS`` and ``DRAFT_GROUPS`` (those holding the
weights of a draft in the same checkpoint: DeepSeek-V3's MTP layers).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

_FORMATS: list[tuple[type, Any]] = []
"""(config class, key map) pairs, filled by the targets' registrations (:mod:`mtp_jax.builtin`)."""


def checkpoint_format(cfg: Any) -> ModuleType:
    """The key-map module that reads checkpoints of ``cfg``'s model family (the most derived
    registered config class wins: a plug-in subclass of a family config may bring its own)."""
    for kind, module in _FORMATS:
        if type(cfg) is kind:
            return module
    for kind, module in _FORMATS:
        if isinstance(cfg, kind):
            return module
    raise TypeError(f"no checkpoint format for a config of type {type(cfg).__name__}")


def register_checkpoint_format(config_class: type, module: Any) -> None:
    """Read checkpoints of configs of ``config_class`` with ``module`` (a module or namespace with
    the functions listed above): a plug-in target's (:func:`mtp_jax.targets.register_target`)."""
    global _FORMATS
    _FORMATS = [(kind, m) for kind, m in _FORMATS if kind is not config_class] + [(config_class, module)]
