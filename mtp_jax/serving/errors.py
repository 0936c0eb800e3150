"""What the engine raises beyond a bad request's InvalidRequestError."""

from __future__ import annotations

from mtp_jax.errors import InvalidRequestError


class EngineFullError(InvalidRequestError):
    """The engine's waiting queue is full: try again later."""


class EngineClosedError(InvalidRequestError):
    """The engine was closed (or its loop failed): it takes no more requests."""
