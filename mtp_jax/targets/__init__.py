"""Target models: pure functions over parameter pytrees, each described by a :class:`Target`."""

from __future__ import annotations

from typing import Any

from mtp_jax.targets import deepseek_v3, llama3, qwen2, qwen3
from mtp_jax.targets.base import Hidden, PagedAttention, Target

TARGETS: tuple[Target, ...] = (deepseek_v3.TARGET, llama3.TARGET, qwen2.TARGET, qwen3.TARGET)
_BUILT_IN = TARGETS


def add_target(target: Target) -> Target:
    """Add ``target`` to :data:`TARGETS` (replacing one of the same config class; a built-in one
    cannot be). Plug-ins call :func:`mtp_jax.plugins.register_target`, which also registers their
    config's ``model_type`` and checkpoint key map."""
    global TARGETS
    if not isinstance(target, Target):
        raise TypeError(f"register_target takes a mtp_jax.targets.Target, got {type(target).__name__}")
    if any(t.config_class is target.config_class for t in _BUILT_IN):
        raise ValueError(f"{target.config_class.__name__} is the config of a built-in target")
    TARGETS = tuple(t for t in TARGETS if t.config_class is not target.config_class) + (target,)
    return target


def target_for(cfg: Any) -> Target:
    """The :class:`Target` of a parsed config (its type decides; the most derived class wins: a
    Qwen2 config is a Llama-family config)."""
    for target in TARGETS:
        if type(cfg) is target.config_class:
            return target
    for target in TARGETS:
        if isinstance(cfg, target.config_class):
            return target
    raise TypeError(f"no target model for a config of type {type(cfg).__name__}")


__all__ = ["TARGETS", "Hidden", "PagedAttention", "Target", "add_target", "target_for"]
