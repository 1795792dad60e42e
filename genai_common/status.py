"""The gRPC status code of a domain error: the one mapping both servers use
(docs/design.md, "Status codes"). Kept apart from ``errors`` so that the
engine, which raises those errors, never imports grpc."""

from __future__ import annotations

import grpc

from .errors import GenAIError


def status_code(error: GenAIError) -> grpc.StatusCode:
    """``error.code`` as a ``grpc.StatusCode``; INTERNAL for a name grpc does not know."""
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)
