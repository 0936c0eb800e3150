"""Target models: pure functions over parameter pytrees, each described by a :class:`Target`."""

from __future__ import annotations

from typing import Any

from mtp_jax.targets import deepseek_v3, llama3, qwen2, qwen3
from mtp_jax.targets.base import Hidden, PagedAttention, Target

TARGETS: tuple[Target, ...] = (deepseek_v3.TARGET, llama3.TARGET, qwen2.TARGET, qwen3.TARGET)


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


__all__ = ["TARGETS", "Hidden", "PagedAttention", "Target", "target_for"]
