"""Domain errors, one class per gRPC status code (docs/design.md, "Status codes").

The engine and the frontend raise these; exactly one place (the servicer
interceptor) maps them to status codes. Engine code never imports grpc.
"""

from __future__ import annotations

import re

# A field path as messages name it: `stopping.stop_sequences[2]`, `messages[0].role`.
_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*)*")


class GenAIError(Exception):
    """Base of every error the service reports to a client.

    ``code`` is the name of the ``grpc.StatusCode`` member it maps to.
    """

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type[GenAIError], tuple[str]]:
        # Errors cross the engine-process boundary by pickle.
        return (type(self), (self.message,))


class InvalidArgument(GenAIError):
    """Bad parameter value, empty input, prompt over the context window, unknown enum.

    The message starts with the field it is about, then says what is wrong:
    ``"sampling.temperature: -1 is below the minimum 0"``. ``field_violation``
    splits it so that a client gets the field as data (google.rpc.BadRequest).
    """

    code = "INVALID_ARGUMENT"

    def field_violation(self) -> tuple[str, str]:
        """``(field path, description)``; the field is ``""`` when the message
        does not start with one."""
        field, sep, description = self.message.partition(": ")
        if sep and _FIELD_PATH.fullmatch(field):
            return field, description
        return "", self.message


class NotFound(GenAIError):
    """Unknown, expired or malformed session id (never says which)."""

    code = "NOT_FOUND"


class FailedPrecondition(GenAIError):
    """The session is already running a turn."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(GenAIError):
    """Queue full, too many sessions, memory budget exceeded."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(GenAIError):
    """Engine starting, restarting or draining."""

    code = "UNAVAILABLE"


class Cancelled(GenAIError):
    code = "CANCELLED"


class DeadlineExceeded(GenAIError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(GenAIError):
    code = "UNAUTHENTICATED"


class PermissionDenied(GenAIError):
    code = "PERMISSION_DENIED"


class DataLoss(GenAIError):
    code = "DATA_LOSS"


class Internal(GenAIError):
    code = "INTERNAL"


class ModelLoadError(Exception):
    """A model directory that cannot work; the message names the missing file or tensor."""
