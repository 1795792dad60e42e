"""Typed exceptions for failed calls, one per gRPC status code the server uses.

Every exception the client raises for a failed RPC is a :class:`GenAIClientError`
carrying the status ``code`` (a :class:`grpc.StatusCode`) and the server's
``details`` message; the subclass tells the code apart (docs/design.md, "Status codes").
The server also sends the status as a ``google.rpc.Status``; its BadRequest
details become ``field_violations`` (the field paths a bad request got wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request: its path (e.g. ``sampling.temperature``;
    empty when the server named none) and what is wrong with it."""

    field: str
    description: str


class GenAIClientError(Exception):
    """A call failed with a gRPC status other than OK.

    Codes without a dedicated subclass (e.g. ``UNIMPLEMENTED``, ``UNKNOWN``)
    are raised as this base class.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str = "",
        code: grpc.StatusCode | None = None,
        field_violations: tuple[FieldViolation, ...] = (),
    ) -> None:
        if code is not None:
            self.code = code
        self.details = details
        self.field_violations = field_violations
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

# google.rpc.Code numbers to grpc.StatusCode.
_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_for(
    code: grpc.StatusCode, details: str, field_violations: tuple[FieldViolation, ...] = ()
) -> GenAIClientError:
    """The exception for a status ``code`` with the server's ``details``."""
    cls = _BY_CODE.get(code, GenAIClientError)
    return cls(details, code=code, field_violations=field_violations)


def error_from_status(status: status_pb2.Status) -> GenAIClientError:
    """The exception for a google.rpc.Status (a GenerateBidi error event, or
    a failed call's details trailer); unknown code numbers: UNKNOWN."""
    violations: list[FieldViolation] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += (FieldViolation(v.field, v.description) for v in bad.field_violations)
    code = _BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    return error_for(code, status.message, tuple(violations))


def from_rpc_error(error: grpc.RpcError) -> GenAIClientError:
    """Translate a failed call (sync or ``grpc.aio``) into its typed exception."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    try:
        # grpc.aio's AioRpcError answers the same three calls synchronously.
        status = rpc_status.from_call(error) if hasattr(error, "trailing_metadata") else None
    except ValueError:  # a details trailer that disagrees with the status: ignore it
        status = None
    if status is not None:
        return error_from_status(status)
    return error_for(code, details or "")
