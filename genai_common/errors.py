"""Domain errors, one class per gRPC status code (docs/design.md, "Status codes").

The engine and the frontend raise these; exactly one place (the servicer
interceptor) maps them to status codes. Engine code never imports grpc.
"""

from __future__ import annotations


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
    """Bad parameter value, empty input, prompt over the context window, unknown enum."""

    code = "INVALID_ARGUMENT"


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
