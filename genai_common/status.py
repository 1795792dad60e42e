"""The gRPC status of a domain error: the one mapping both servers use
(docs/design.md, "Status codes"). Kept apart from ``errors`` so that the
engine, which raises those errors, never imports grpc.

A failed call carries its status twice, as gRPC does it: the code and message
in the call's status, and the same as a ``google.rpc.Status`` (with details,
e.g. a ``google.rpc.BadRequest`` for INVALID_ARGUMENT) in the
``grpc-status-details-bin`` trailer, which ``grpc_status.rpc_status`` reads.
GenerateBidi sends that same ``google.rpc.Status`` as a request's error event.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from .errors import GenAIError, InvalidArgument


def status_code(error: GenAIError) -> grpc.StatusCode:
    """``error.code`` as a ``grpc.StatusCode``; INTERNAL for a name grpc does not know."""
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)


# A failed call's message travels in grpc-message and twice more, base64, in
# grpc-status-details-bin; clients refuse metadata over 16 KiB in all, so the
# message (a parser's can repeat the input several times) is cut here.
MAX_MESSAGE_CHARS = 2048


def _cut(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "\u2026"


def rpc_status_of(error: GenAIError) -> status_pb2.Status:
    """``error`` as a google.rpc.Status: code, message (at most
    ``MAX_MESSAGE_CHARS``), and for a bad argument a BadRequest naming the field."""
    status = status_pb2.Status(code=status_code(error).value[0], message=_cut(error.message))
    if isinstance(error, InvalidArgument):
        field, description = error.field_violation()
        description = _cut(description)
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=field, description=description
                    )
                ]
            )
        )
        status.details.append(detail)
    return status


async def abort(context: grpc.aio.ServicerContext, error: GenAIError) -> NoReturn:
    """End the call with ``error``'s status, details in the trailer."""
    status = rpc_status.to_status(rpc_status_of(error))
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")
