"""The models shipped in the repository's ``checkpoints/`` folder, trained by ``scripts/train_tiny.py``."""

from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "tiny-deepseek-v3-stdlib"
"""What ``mtp-jax generate`` and ``mtp-jax bench`` use without ``--model`` (or $MTP_JAX_MODEL)."""


def checkpoints_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


def default_model_dir() -> str | None:
    """$MTP_JAX_MODEL if set, else the embedded default model's directory (None if it is missing,
    e.g. in an installed wheel without the repository)."""
    env = os.environ.get("MTP_JAX_MODEL")
    if env:
        return env
    candidate = os.path.join(checkpoints_dir(), DEFAULT_MODEL_NAME)
    return candidate if os.path.isdir(candidate) else None
