"""Names of the call metadata (gRPC) and headers (HTTP) the planes share."""

from __future__ import annotations

# A session's id. On gRPC, sent beside the request's session_id by every
# client, for proxies that hash on it; on the HTTP gateway it names the
# session a completion continues. See docs/design.md, "Routing a session's turns".
SESSION_ID_HEADER = "x-session-id"
# HTTP gateway: what a completion does at the context window ("error" or
# "slide"; GenerateRequest.context_overflow). A body field of the same name wins.
CONTEXT_OVERFLOW_HEADER = "x-context-overflow"


def header_safe(value: str) -> bool:
    """Whether ``value`` can travel as a metadata value: printable ASCII (a
    session id that is not is unknown to the server, which says so)."""
    return value.isascii() and value.isprintable()
