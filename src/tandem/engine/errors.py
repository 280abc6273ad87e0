"""Engine error types. The HTTP layer maps `InvalidRequestError` to 400."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; raised from `__post_init__` of config dataclasses."""


class InvalidRequestError(ValueError):
    """A client-supplied value is invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the HTTP layer maps it to 429."""


class UnknownAdapterError(InvalidRequestError):
    """A request named a LoRA adapter that is not loaded; the HTTP layer maps it to 404."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the LoRA adapter {name!r} is not loaded", "model")
        self.name = name


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank died): every request
    fails, the loop stops, the worker's readiness goes down and it exits."""
