"""Target models: pure functions over parameter pytrees, each described by a :class:`Target`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mtp_jax.targets import deepseek_v3, llama3, qwen2, qwen3
from mtp_jax.targets.base import Hidden, PagedAttention, Target

TARGETS: tuple[Target, ...] = (deepseek_v3.TARGET, llama3.TARGET, qwen2.TARGET, qwen3.TARGET)
_BUILT_IN = TARGETS


def register_target(
    target: Target,
    *,
    model_types: tuple[str, ...] = (),
    parse: Callable[[Mapping[str, Any]], Any] | None = None,
    checkpoint_format: Any = None,
) -> Target:
    """Add a target model (a plug-in, defined outside this package): ``target`` runs with every
    draft through the step, the engine, ``plan``, the roofline, the estimates and the CLI.
    ``model_types`` with ``parse(raw) -> config``: config.json ``model_type`` values whose configs
    ``parse`` reads (into an instance of ``target.config_class``); ``checkpoint_format``: the key map
    that reads and writes its hub checkpoints (a module like :mod:`mtp_jax.checkpoint.llama3`;
    None: the one of a registered base class of its config). A target of the same config class is
    replaced; the built-in ones cannot be."""
    global TARGETS
    if not isinstance(target, Target):
        raise TypeError(f"register_target takes a mtp_jax.targets.Target, got {type(target).__name__}")
    if any(t.config_class is target.config_class for t in _BUILT_IN):
        raise ValueError(f"{target.config_class.__name__} is the config of a built-in target")
    if model_types and parse is None:
        raise ValueError("model_types need parse, the function that reads such a config")
    from mtp_jax.config import register_model_type

    for model_type in model_types:
        register_model_type(model_type, parse)
    if checkpoint_format is not None:
        from mtp_jax.checkpoint.formats import register_checkpoint_format

        register_checkpoint_format(target.config_class, checkpoint_format)
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


__all__ = ["TARGETS", "Hidden", "PagedAttention", "Target", "register_target", "target_for"]
