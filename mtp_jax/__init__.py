"""mtp-jax: speculative decoding for DeepSeek-V3-family models and Llama 3 in JAX.

The public names below are imported on first use (PEP 562), so importing one submodule (say the
FP8 weight type, which the kernels in ``pallas_kernels`` use) does not import the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AdapterError": "mtp_jax.errors",
    "CheckpointError": "mtp_jax.errors",
    "CheckpointNotFoundError": "mtp_jax.errors",
    "ConfigError": "mtp_jax.errors",
    "InvalidRequestError": "mtp_jax.errors",
    "MtpJaxError": "mtp_jax.errors",
    "DeepseekV3Config": "mtp_jax.config",
    "Completion": "mtp_jax.serving",
    "Engine": "mtp_jax.serving",
    "EngineClosedError": "mtp_jax.serving",
    "EngineFullError": "mtp_jax.serving",
    "RequestHandle": "mtp_jax.serving",
    "GenerateResult": "mtp_jax.engine",
    "TokenLogprob": "mtp_jax.engine",
    "Model": "mtp_jax.model",
    "ScoreResult": "mtp_jax.model",
    "SamplingParams": "mtp_jax.request",
    "SpeculativeConfig": "mtp_jax.request",
    "load": "mtp_jax.model",
    "make_mesh": "mtp_jax.sharding",
}

__all__ = [
    "AdapterError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Completion",
    "ConfigError",
    "DeepseekV3Config",
    "Engine",
    "EngineClosedError",
    "EngineFullError",
    "GenerateResult",
    "InvalidRequestError",
    "Model",
    "MtpJaxError",
    "RequestHandle",
    "SamplingParams",
    "ScoreResult",
    "SpeculativeConfig",
    "TokenLogprob",
    "load",
    "make_mesh",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mtp_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from mtp_jax.config import DeepseekV3Config
    from mtp_jax.engine import GenerateResult
    from mtp_jax.errors import (
        AdapterError,
        CheckpointError,
        CheckpointNotFoundError,
        ConfigError,
        InvalidRequestError,
        MtpJaxError,
    )
    from mtp_jax.model import Model, ScoreResult, load
    from mtp_jax.serving import Completion, Engine, EngineClosedError, EngineFullError, RequestHandle
    from mtp_jax.sharding import make_mesh
