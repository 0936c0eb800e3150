"""mtp-jax: speculative decoding for DeepSeek-V3-family models in JAX."""

from mtp_jax.config import DeepseekV3Config
from mtp_jax.engine import GenerateResult
from mtp_jax.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    InvalidRequestError,
    MtpJaxError,
)
from mtp_jax.model import Model, ScoreResult, load
from mtp_jax.sharding import make_mesh

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "DeepseekV3Config",
    "GenerateResult",
    "InvalidRequestError",
    "Model",
    "MtpJaxError",
    "ScoreResult",
    "load",
    "make_mesh",
]
