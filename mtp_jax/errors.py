"""Exception types. Each derives from the builtin a caller would naturally catch."""

from __future__ import annotations


class MtpJaxError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(MtpJaxError, ValueError):
    """A config.json that is malformed, inconsistent or describes an unsupported model."""


class CheckpointError(MtpJaxError, ValueError):
    """A checkpoint whose tensors are missing, malformed, or of an unsupported format."""


class CheckpointNotFoundError(MtpJaxError, FileNotFoundError):
    """A checkpoint directory or one of its files does not exist."""


class InvalidRequestError(MtpJaxError, ValueError):
    """Bad input to a model call: token ids, sampling parameters, lengths."""


class AdapterError(MtpJaxError, ValueError):
    """A LoRA adapter that cannot be applied to this model (names the adapter and the problem)."""
