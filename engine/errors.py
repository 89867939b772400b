"""The engine's typed errors. Callers map them by type, never by message text: an
`InvalidRequestError` is the caller's fault (HTTP 400, naming `param`), a `QueueFullError` or
`EngineDeadError` is the server's state (503); anything else is a bug (HTTP 500)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input, found before anything is queued. `param` names the offending parameter
    (an OpenAI request field such as `max_tokens`, `prompt` or `messages`), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-len; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The step loop stopped; no request can make progress."""
