"""Registering models defined outside the package.

A draft registers with :func:`mtp_jax.drafts.register_draft`; a target with :func:`register_target`
here, which also teaches the config parser its ``model_type`` and the loader its checkpoint key map
(this module sits above the three so that none of them imports another).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mtp_jax.checkpoint.formats import register_checkpoint_format
from mtp_jax.config import register_model_type
from mtp_jax.targets import Target, add_target


def register_target(
    target: Target,
    *,
    model_types: tuple[str, ...] = (),
    parse: Callable[[Mapping[str, Any]], Any] | None = None,
    checkpoint_format: Any = None,
) -> Target:
    """Add a target model: ``target`` then runs with every draft through the step, the engine,
    ``plan``, the roofline, the estimates and the CLI. ``model_types`` with ``parse(raw) -> config``:
    config.json ``model_type`` values whose configs ``parse`` reads (into an instance of
    ``target.config_class``); ``checkpoint_format``: the key map that reads and writes its hub
    checkpoints (a module like :mod:`mtp_jax.checkpoint.llama3`; None: the one of a registered base
    class of its config). A target of the same config class is replaced; a built-in one cannot be."""
    if model_types and parse is None:
        raise ValueError("model_types need parse, the function that reads such a config")
    add_target(target)  # checks the target first
    for model_type in model_types:
        register_model_type(model_type, parse)
    if checkpoint_format is not None:
        register_checkpoint_format(target.config_class, checkpoint_format)
    return target
