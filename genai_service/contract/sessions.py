"""Sessions as they cross the process boundary: the snapshot and the page the
engine answers with, and the metadata rules both sides check (docs/design.md,
"Sessions")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from genai_common.errors import InvalidArgument

from ..config import SessionConfig


@dataclass(frozen=True)
class SessionInfo:
    """A snapshot of a session, safe to hand across process boundaries."""

    session_id: str
    created_at: float
    last_used_at: float
    idle_ttl_s: float
    history_tokens: int
    turns: int
    busy: bool
    metadata: dict[str, str] = field(default_factory=dict)
    last_token_id: int | None = None  # lets the frontend continue a chat template
    context_overflow: str = "error"  # its turns' default: "error" or "slide"
    dropped_tokens: int = 0  # history dropped by slides since creation or reset


@dataclass(frozen=True)
class SessionPage:
    """One page of ListSessions: sessions oldest first, and the next page's token."""

    sessions: list[SessionInfo]
    next_page_token: str = ""  # "": the last page


def _key_label(key: str) -> str:
    """How a metadata key appears in an error: quoted, cut at 32 characters."""
    return repr(key[:32]) + ("…" if len(key) > 32 else "")


def check_metadata(metadata: Mapping[str, str], limits: SessionConfig) -> None:
    """Raise ``InvalidArgument`` unless CreateSession ``metadata`` is within
    ``limits`` (entries, UTF-8 bytes per key, per value and in all). Counts
    entries before reading any, so a huge map costs nothing more."""
    if len(metadata) > limits.max_metadata_entries:
        raise InvalidArgument(
            f"metadata: {len(metadata)} entries; at most {limits.max_metadata_entries} allowed"
        )
    total = 0
    for key, value in metadata.items():
        key_bytes, value_bytes = len(key.encode()), len(value.encode())
        if key_bytes > limits.max_metadata_key_bytes:
            raise InvalidArgument(
                f"metadata: key {_key_label(key)} is {key_bytes} bytes; "
                f"at most {limits.max_metadata_key_bytes} allowed"
            )
        if value_bytes > limits.max_metadata_value_bytes:
            raise InvalidArgument(
                f"metadata: the value of key {_key_label(key)} is {value_bytes} bytes; "
                f"at most {limits.max_metadata_value_bytes} allowed"
            )
        total += key_bytes + value_bytes
    if total > limits.max_metadata_bytes:
        raise InvalidArgument(
            f"metadata: {total} bytes of keys and values; "
            f"at most {limits.max_metadata_bytes} allowed"
        )
