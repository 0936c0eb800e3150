"""Target models: pure functions over parameter pytrees, each described by a :class:`Target`.

The registry starts empty: every target, the shipped ones (:mod:`mtp_jax.builtin`) and plug-ins
alike, arrives through :func:`register_target`, which also teaches the config parser its
``model_type`` values and the loader its checkpoint key map. Each family lives in a folder of its
own (``deepseek_v3/``, ``llama/``): model code, config, key map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mtp_jax.checkpoint.formats import register_checkpoint_format
from mtp_jax.config import register_model_type
from mtp_jax.targets.base import Hidden, PagedAttention, Target

TARGETS: tuple[Target, ...] = ()
"""The registered targets (read it live: registrations add to it)."""
_BUILT_IN: set[type] = set()


def add_target(target: Target) -> Target:
    """Add ``target`` to :data:`TARGETS` (replacing one of the same config class; a built-in one
    cannot be). :func:`register_target` also registers its ``model_type`` and checkpoint key map."""
    global TARGETS
    if not isinstance(target, Target):
        raise TypeError(f"register_target takes a mtp_jax.targets.Target, got {type(target).__name__}")
    if target.config_class in _BUILT_IN:
        raise ValueError(f"{target.config_class.__name__} is the config of a built-in target")
    TARGETS = tuple(t for t in TARGETS if t.config_class is not target.config_class) + (target,)
    return target


def register_target(
    target: Target,
    *,
    model_types: tuple[str, ...] = (),
    parse: Callable[[Mapping[str, Any]], Any] | None = None,
    checkpoint_format: Any = None,
    gguf: Any = None,
    built_in: bool = False,
) -> Target:
    """Add a target model: ``target`` then runs with every draft through the step, the engine,
    ``plan``, the roofline, the estimates and the CLI. ``model_types`` with ``parse(raw) -> config``:
    config.json ``model_type`` values whose configs ``parse`` reads (into an instance of
    ``target.config_class``); ``checkpoint_format``: the key map that reads and writes its hub
    checkpoints (a module like :mod:`mtp_jax.targets.llama.checkpoint`; None: the one of a
    registered base class of its config); ``gguf``: a
    :class:`~mtp_jax.checkpoint.gguf.GGUFLayout`, the GGUF architectures it reads (llama.cpp's
    single-file checkpoints). A target of the same config class is replaced; a built-in
    one (``built_in``: the package's own registrations) cannot be."""
    if model_types and parse is None:
        raise ValueError("model_types need parse, the function that reads such a config")
    add_target(target)  # checks the target first
    for model_type in model_types:
        register_model_type(model_type, parse, built_in=built_in)
    if checkpoint_format is not None:
        register_checkpoint_format(target.config_class, checkpoint_format)
    if gguf is not None:
        from mtp_jax.checkpoint.gguf import register_gguf_layout

        register_gguf_layout(gguf)
    if built_in:
        _BUILT_IN.add(target.config_class)
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


__all__ = ["TARGETS", "Hidden", "PagedAttention", "Target", "add_target", "register_target", "target_for"]
