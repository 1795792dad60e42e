"""Python client of genai-grpc (the genai.v1 control plane).

``Client`` is synchronous, ``AsyncClient`` is its asyncio twin; both return
the plain dataclasses of :mod:`genai_client.types` and raise the typed
exceptions of :mod:`genai_client.errors`.
"""

from __future__ import annotations

from genai_client._convert import GenerateOptions
from genai_client.aio import AsyncBidiStream, AsyncClient, AsyncGenerationStream, AsyncSession
from genai_client.client import BidiStream, Client, GenerationStream, Session
from genai_client.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    FieldViolation,
    GenAIClientError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from genai_client.types import (
    BidiEvent,
    ChatMessage,
    Completion,
    Delta,
    GenerationResult,
    KvLayout,
    ModelInfo,
    SessionInfo,
    Token,
    TokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncBidiStream",
    "AsyncClient",
    "AsyncGenerationStream",
    "AsyncSession",
    "BidiEvent",
    "BidiStream",
    "CancelledError",
    "ChatMessage",
    "Completion",
    "Client",
    "DeadlineExceededError",
    "Delta",
    "FailedPreconditionError",
    "FieldViolation",
    "GenAIClientError",
    "GenerateOptions",
    "GenerationResult",
    "GenerationStream",
    "InternalError",
    "InvalidArgumentError",
    "KvLayout",
    "ModelInfo",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "Session",
    "SessionInfo",
    "Token",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "TopLogprob",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
]
