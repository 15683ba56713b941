"""The base of every error whose message is meant for the user: front ends print it, no traceback."""


class UserError(Exception):
    """Bad config, model, request or input; the message says what is wrong and how to fix it."""


class RequestRejected(UserError, ValueError):
    """The request can never run here (empty, too long for the context or the K/V pool)."""


class PromptTooLong(RequestRejected):
    """A prompt longer than the context or the K/V pool allows: `tokens` it has, `most` that fit."""

    def __init__(self, message: str, tokens: int, most: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.most = most


class QueueFull(RuntimeError):
    """Too many requests are waiting; retry later."""


class EngineBusy(RuntimeError):
    """What is read between two steps (statistics) did not come within the caller's wait: a step is
    taking that long. Retry."""
