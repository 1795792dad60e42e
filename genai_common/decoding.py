"""Requests that do not decode become a value, so they can be answered INVALID_ARGUMENT.

gRPC calls a handler's ``request_deserializer`` before any servicer code runs;
when protobuf raises ``DecodeError`` there (invalid UTF-8 in a string field,
corrupt wire bytes), grpc.aio answers ``UNKNOWN "Unexpected <class ...>"``.
``TolerantDecoding`` wraps the deserializers of the services it is given, so
a message that does not decode arrives as an ``Undecodable`` instead (as the
request, or as an item of a request stream), and the servicer's error mapping
answers ``INVALID_ARGUMENT`` naming the problem (docs/design.md, "Status codes").

Both servers use it: the frontend for the genai.v1 services and ``genai-kvstore``
for kvstore.v1 (which imports nothing from ``genai_service``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from .errors import InvalidArgument


@dataclass(frozen=True)
class Undecodable:
    """A request message that protobuf could not decode."""

    message: str  # says which message type and why

    def error(self) -> InvalidArgument:
        return InvalidArgument(self.message)


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, returning an ``Undecodable`` where it would raise ``DecodeError``."""
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = descriptor.full_name if descriptor is not None else "message"

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            # upb: "Error parsing message with type 'X': String field had bad UTF-8"
            reason = str(exc).rpartition(": ")[2] or "the bytes do not parse"
            reason = reason[:1].lower() + reason[1:]
            return Undecodable(f"request is not a valid {type_name}: {reason}")

    return decode


class TolerantDecoding(grpc.aio.ServerInterceptor):
    """Gives the handlers of ``services`` (full names) tolerant deserializers."""

    def __init__(self, services: Iterable[str]) -> None:
        self._prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        # RpcMethodHandler is a namedtuple: swap only the deserializer.
        return handler._replace(request_deserializer=tolerant(handler.request_deserializer))
