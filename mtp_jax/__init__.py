"""mtp-jax: speculative decoding for DeepSeek-V3-family models and Llama 3 in JAX.

Importing the package registers the shipped targets and drafts (:mod:`mtp_jax.builtin`) and
exposes the public names below.
"""

from __future__ import annotations

import mtp_jax.builtin  # noqa: F401  (registers the shipped targets and drafts)
from mtp_jax.errors import (
    AdapterError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    InvalidRequestError,
    MtpJaxError,
)
from mtp_jax.model import Model, load
from mtp_jax.request import SamplingParams, SpeculativeConfig
from mtp_jax.scheduler import GenerateResult, TokenLogprob
from mtp_jax.scoring import ScoreResult
from mtp_jax.serving import Completion, Engine, EngineClosedError, EngineFullError, RequestHandle
from mtp_jax.sharding import make_mesh
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config

__version__ = "0.1.0"

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
