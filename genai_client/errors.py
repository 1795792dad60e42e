"""Typed exceptions for failed calls, one per gRPC status code the server uses.

Every exception the client raises for a failed RPC is a :class:`GenAIClientError`
carrying the status ``code`` (a :class:`grpc.StatusCode`) and the server's
``details`` message; the subclass tells the code apart (docs/design.md, "Status codes").
"""

from __future__ import annotations

import grpc


class GenAIClientError(Exception):
    """A call failed with a gRPC status other than OK.

    Codes without a dedicated subclass (e.g. ``UNIMPLEMENTED``, ``UNKNOWN``)
    are raised as this base class.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None) -> None:
        if code is not None:
            self.code = code
        self.details = details
        super().__init__(f"{self.code.name}: {details}" if details else self.code.name)


class InvalidArgumentError(GenAIClientError):
    """A parameter value is out of range, the input is empty, or the prompt is
    longer than the context window; ``details`` names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(GenAIClientError):
    """The session id is unknown, expired or malformed."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(GenAIClientError):
    """The session is already running a turn."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(GenAIClientError):
    """The queue is full, or the session limit or memory budget is reached."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(GenAIClientError):
    """The server is unreachable, or its engine is starting, restarting or
    draining; retrying later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(GenAIClientError):
    """The call's deadline (``timeout``) passed before it completed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(GenAIClientError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class UnauthenticatedError(GenAIClientError):
    """The bearer token is missing or invalid."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(GenAIClientError):
    """The session belongs to another principal."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InternalError(GenAIClientError):
    """The server failed unexpectedly (it logs the request id and traceback)."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[GenAIClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledError,
        UnauthenticatedError,
        PermissionDeniedError,
        InternalError,
    )
}

# google.rpc.Code numbers (as sent in genai.v1.ErrorStatus) to grpc.StatusCode.
_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_for(code: grpc.StatusCode, details: str) -> GenAIClientError:
    """The exception for a status ``code`` with the server's ``details``."""
    cls = _BY_CODE.get(code, GenAIClientError)
    return cls(details, code=code)


def error_for_number(code: int, details: str) -> GenAIClientError:
    """The exception for a numeric google.rpc.Code (unknown numbers: UNKNOWN)."""
    return error_for(_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN), details)


def from_rpc_error(error: grpc.RpcError) -> GenAIClientError:
    """Translate a failed call (sync or ``grpc.aio``) into its typed exception."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_for(code, details or "")
