"""The session table: persistent multi-turn conversations.

A session owns its token history and, while parked between turns, the KV of
that history. A turn appends the new input to the history and prefills only
the new tokens. Plain Python; the KV is an opaque object the engine gets from
and gives back to the model runner.

With a kvstore, each session is also persisted as a small JSON record (under
``record_key``, sealed by the connector like every blob) so that an evicted
session, or one created on another replica sharing the integrity secret, can
be restored from it. The table never fetches records itself: the engine does,
off its loop, and hands what arrives to ``adopt``.

Metadata and listings are bounded (docs/design.md, "Sessions"):
``check_metadata`` (contract/sessions.py, which the frontend checks too)
before a session is created, ``SessionTable.page`` for ListSessions.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import hashlib
import json
import math
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from genai_common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

from ...config import CONTEXT_OVERFLOWS, SESSION_LIST_PAGE_BYTES
from ...contract.sessions import SessionInfo
from ..kv.prefix_cache import KvLayers, kv_nbytes

log = structlog.get_logger(__name__)

SESSION_ID_BYTES = 16  # 128-bit random ids (docs/design.md, "Security")
_SESSION_ID = re.compile(r"[0-9a-f]{32}")  # secrets.token_hex(SESSION_ID_BYTES)
DEFAULT_PAGE_SIZE = 50  # ListSessions page_size 0 (AIP-158)
MAX_PAGE_SIZE = 1000  # larger page sizes are lowered to it (AIP-158)
# Upper bound of a listed session's wire size besides its metadata: the id,
# two timestamps, four integers, the flag and the field's own tag and length.
_SESSION_FIXED_BYTES = 100
_METADATA_ENTRY_BYTES = 12  # a map entry's tags and lengths, besides its key and value
GONE = -1  # a turn end the context window has slid past (RewindSession cannot go there)


@dataclass(eq=False)
class Session:
    session_id: str
    created_at: float
    last_used_at: float
    idle_ttl_s: float
    owner: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    history: list[int] = field(default_factory=list)
    turns: int = 0
    # len(history) after each completed turn (RewindSession's turn targets);
    # a record written before they were kept has none (only token targets then).
    turn_ends: list[int] = field(default_factory=list)
    # Bumped by every saved change (its record carries it): a record with a
    # higher version was written by another replica since (``SessionTable.adopt``).
    version: int = 0
    # Read from a record that says the session was closed (on any replica).
    closed: bool = False
    context_overflow: str = "error"  # its turns' default at the window: "error" or "slide"
    dropped_tokens: int = 0  # history dropped by slides since creation or reset
    # Mirostat v2's mu after the last turn that used Mirostat (the next such
    # turn continues it); None: none did since creation, reset or rewind.
    mirostat_mu: float | None = None
    # Non-empty once a slide moved the keys of its KV (kv/window.next_lineage):
    # its history's chunk keys chain from it.
    lineage: bytes = b""
    # KV of history[:kv_len] while parked, as consecutive chunks (complete ones
    # shared with the prefix index); None while a turn runs or after reset.
    kv: list[Any] | None = None
    kv_len: int = 0
    running_request_id: str | None = None  # the turn in flight (user-visible "busy")
    # The last turn's final token is still being computed (for a fork made
    # meanwhile: its parent's is, and its KV comes from there, ``heirs``).
    committing: bool = False
    # Forks made while this session was committing (forks of those forks too):
    # they get their share of the KV once it is computed (``LLMEngine._park_session``).
    heirs: list[Session] = field(default_factory=list)
    heir_of: Session | None = None  # the committing session whose KV this one awaits

    @property
    def busy(self) -> bool:
        return self.running_request_id is not None

    @property
    def kv_ready(self) -> bool:
        return not self.committing

    def take_heirs(self) -> list[Session]:
        """The forks that waited on this session's commit, waiting no longer."""
        heirs, self.heirs = self.heirs, []
        for heir in heirs:
            heir.committing, heir.heir_of = False, None
        return heirs


def not_found(session_id: str) -> NotFound:
    # Never say whether the id was unknown, expired or malformed (docs/design.md, "Status codes").
    return NotFound(f"session_id: no session {session_id[:64]!r}")


def listed_bytes(session: Session) -> int:
    """An upper bound of ``session``'s size in a ListSessions response."""
    return _SESSION_FIXED_BYTES + sum(
        len(k.encode()) + len(v.encode()) + _METADATA_ENTRY_BYTES
        for k, v in session.metadata.items()
    )


def _order(session: Session) -> tuple[float, str]:
    """Listing order: oldest first; the id breaks ties (stable across pages)."""
    return session.created_at, session.session_id


def _page_token(session: Session) -> str:
    raw = json.dumps(list(_order(session))).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _parse_page_token(token: str) -> tuple[float, str]:
    """The listing position a ``_page_token`` names; ``InvalidArgument`` for anything else."""
    try:
        created_at, session_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        if (
            isinstance(created_at, float | int)
            and not isinstance(created_at, bool)
            and isinstance(session_id, str)
            and is_session_id(session_id)
        ):
            return float(created_at), session_id
    except (binascii.Error, UnicodeError, ValueError, TypeError):
        pass
    raise InvalidArgument(f"page_token: {token[:64]!r} is not a next_page_token of ListSessions")


class SessionTable:
    def __init__(
        self,
        max_sessions: int,
        idle_ttl_s: float,
        clock: Callable[[], float] = time.time,  # wall clock: timestamps are shown to users
        on_evict: Callable[[Session], None] | None = None,
        persistent: bool = False,
        on_forget: Callable[[str], None] | None = None,
    ) -> None:
        """With ``persistent`` (sessions have kvstore records), an idle session
        past its TTL, or the least recently used idle one when the table is
        full, is only evicted from memory; the engine brings it back from its
        record on its next use (``adopt``). ``on_forget(session_id)``: the
        session was reset, closed, expired, evicted from memory or replaced by a
        newer record (what else is kept per session, a draft model's KV, goes
        with it)."""
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._on_evict = on_evict
        self._on_forget = on_forget
        self.persistent = persistent
        self._sessions: dict[str, Session] = {}
        self.evicted = 0
        self.restored = 0
        self.replaced = 0  # in-memory copies replaced by a newer record

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def create(
        self,
        idle_ttl_s: float | None = None,
        owner: str = "",
        metadata: dict[str, str] | None = None,
        context_overflow: str = "error",
    ) -> Session:
        self.expire_idle()
        self._make_room()
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"sessions: {len(self._sessions)} open, the limit is {self.max_sessions}; "
                "close one or retry later"
            )
        ttl = self.idle_ttl_s if idle_ttl_s is None else idle_ttl_s
        if not ttl > 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {ttl}")
        now = self._clock()
        session = Session(
            secrets.token_hex(SESSION_ID_BYTES),
            now,
            now,
            ttl,
            owner,
            dict(metadata or {}),
            context_overflow=context_overflow,
        )
        self._sessions[session.session_id] = session
        return session

    def find(self, session_id: str) -> Session | None:
        """The session if it is in memory (and not expired), else None."""
        session = self._sessions.get(session_id)
        if session is not None and self._expired(session, self._clock()):
            self._drop(session)
            session = None
        return session

    def get(self, session_id: str) -> Session:
        session = self.find(session_id)
        if session is None:
            raise not_found(session_id)
        return session

    def adopt(self, session: Session) -> Session:
        """Take in a session restored from its record. The one already in memory
        under its id wins (a turn may have created or restored it meanwhile),
        unless the record is newer: another replica ran turns of it (or reset
        it) since, so the copy here is stale and its parked KV is dropped."""
        present = self.find(session.session_id)
        if present is not None:
            if present.busy or present.committing or session.version < present.version:
                return present
            if session.version == present.version and session.history == present.history:
                return present  # current: keep its parked KV
            # Newer, or as new but different (two replicas wrote the same
            # version: the shared record wins), or closed elsewhere.
            self._drop(present)
            self.replaced += 1
        if session.closed:
            raise not_found(session.session_id)
        self._make_room()
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"sessions: {len(self._sessions)} busy in memory, the limit is "
                f"{self.max_sessions}; retry later"
            )
        self._sessions[session.session_id] = session
        self.restored += 1
        return session

    def _make_room(self) -> None:
        """Evict the least recently used idle session when full (only when evicted
        sessions can be restored)."""
        if not self.persistent or len(self._sessions) < self.max_sessions:
            return
        idle = [s for s in self._sessions.values() if not s.busy and not s.committing]
        if idle:
            self._drop(min(idle, key=lambda s: s.last_used_at))
            self.evicted += 1

    def begin_turn(self, session_id: str, request_id: str) -> Session:
        session = self.get(session_id)
        if session.busy:
            raise FailedPrecondition(
                f"session_id: session {session_id!r} is already running a turn; "
                "wait for it to finish"
            )
        session.running_request_id = request_id
        session.last_used_at = self._clock()
        return session

    def end_turn(self, session: Session) -> None:
        session.running_request_id = None
        session.last_used_at = self._clock()

    def reset(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.busy:
            raise FailedPrecondition(
                f"session_id: session {session_id!r} is running a turn; it cannot be reset now"
            )
        self._release_kv(session)
        session.history = []
        session.turns = 0
        session.turn_ends = []
        session.dropped_tokens = 0
        session.lineage = b""
        session.mirostat_mu = None
        session.last_used_at = self._clock()
        return session

    def rewind(
        self, session_id: str, turns: int | None = None, history_tokens: int | None = None
    ) -> Session:
        """Keep the first ``turns`` completed turns, or the first
        ``history_tokens`` tokens, of a session's history; the parked KV of
        what is kept stays (cut at the new end)."""
        session = self.get(session_id)
        # (A turn whose last token is still being committed is done: its KV is
        # parked afterwards for what the history then holds, KvReuse.park.)
        if session.busy:
            raise FailedPrecondition(
                f"session_id: session {session_id!r} is running a turn; it cannot be rewound now"
            )
        end = history_end(session, turns, history_tokens)
        known = len(session.turn_ends) == session.turns
        if turns is not None:
            session.turns = turns
        elif known:
            session.turns = sum(e <= end for e in session.turn_ends)
        elif end < len(session.history):
            session.turns = 0  # a record without boundaries: the cut's turn is unknown
        if end < len(session.history):
            session.mirostat_mu = None  # (mu is kept for the latest turn end only)
        session.history = session.history[:end]
        session.turn_ends = [e for e in session.turn_ends if e <= end]
        if session.kv is not None:
            session.kv, session.kv_len = cut_chunks(session.kv, min(session.kv_len, end))
            if not session.kv:
                session.kv = None
        session.last_used_at = self._clock()
        return session

    def fork(
        self,
        parent: Session,
        turns: int | None,
        idle_ttl_s: float | None,
        owner: str,
        metadata: dict[str, str] | None,
    ) -> Session:
        """A new session with ``parent``'s history (or its first ``turns``
        turns) and its parked KV: the same chunk arrays, which nothing writes
        to, so neither session's turns change the other's."""
        end = history_end(parent, turns, None)
        # Taken before ``create``, which may evict the least recently used idle
        # session (the parent too, its parked KV released) to make room.
        history, turn_ends = parent.history[:end], [e for e in parent.turn_ends if e <= end]
        kv: builtins.list[KvLayers] = []
        n = 0
        if parent.kv is not None and parent.kv_ready:
            kv, n = cut_chunks(parent.kv, min(parent.kv_len, end))
        parent.last_used_at = self._clock()  # a fork is a use
        child = self.create(idle_ttl_s, owner, metadata, parent.context_overflow)
        child.history, child.turn_ends = history, turn_ends
        child.dropped_tokens, child.lineage = parent.dropped_tokens, parent.lineage
        child.mirostat_mu = parent.mirostat_mu if end == len(parent.history) else None
        child.turns = parent.turns if turns is None else turns
        if kv:
            child.kv, child.kv_len = kv, n
        elif parent.committing:
            # The parent's last token is computed this step (or, for a fork
            # still waiting itself, its source's): the child's first turn
            # waits for that KV too, rather than recompute the history.
            source = parent.heir_of or parent
            child.committing, child.heir_of = True, source
            source.heirs.append(child)
        return child

    def close(self, session_id: str) -> Session:
        session = self.get(session_id)
        self._drop(session)
        return session

    def list(self) -> list[Session]:
        self.expire_idle()
        return list(self._sessions.values())

    def page(
        self, owner: str | None, page_size: int, page_token: str
    ) -> tuple[builtins.list[Session], str]:
        """One ListSessions page (AIP-158) of the sessions ``owner`` holds (all
        when None), oldest first, and the next page's token ("" at the end).
        At most ``page_size`` sessions (0: DEFAULT_PAGE_SIZE; above
        MAX_PAGE_SIZE: that) and SESSION_LIST_PAGE_BYTES, but at least one."""
        if page_size < 0:
            raise InvalidArgument(
                f"page_size: {page_size} is negative; allowed [0, {MAX_PAGE_SIZE}] "
                f"(0: {DEFAULT_PAGE_SIZE})"
            )
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _parse_page_token(page_token) if page_token else None
        listed = sorted(
            (
                s
                for s in self.list()
                if (owner is None or s.owner == owner) and (after is None or _order(s) > after)
            ),
            key=_order,
        )
        out: builtins.list[Session] = []
        used = 0
        for session in listed:
            n = listed_bytes(session)
            if len(out) == size or (out and used + n > SESSION_LIST_PAGE_BYTES):
                break
            out.append(session)
            used += n
        return out, _page_token(out[-1]) if len(out) < len(listed) else ""

    def trim_parked_kv(self, budget_bytes: int) -> int:
        """Drop the parked KV of the least recently used sessions until what is
        parked fits ``budget_bytes``; returns how many sessions lost theirs
        (their next turn recomputes the history, or fetches it from the kvstore)."""
        parked = [(s, s.kv) for s in self.list() if s.kv is not None]  # expires idle ones first
        # Sessions may share chunks (with the prefix index, and so with each
        # other): count each chunk once, and free its bytes with its last holder.
        holders: Counter[int] = Counter(id(c) for _, kv in parked for c in kv)
        unique = {id(c): c for _, kv in parked for c in kv}
        total = sum(kv_nbytes(c) for c in unique.values())
        dropped = 0
        for session, kv in sorted(parked, key=lambda p: p[0].last_used_at):
            if total <= budget_bytes:
                break
            for chunk in kv:
                holders[id(chunk)] -= 1
                if not holders[id(chunk)]:
                    total -= kv_nbytes(chunk)
            session.kv, session.kv_len = None, 0
            dropped += 1
        return dropped

    def expire_idle(self) -> builtins.list[Session]:
        now = self._clock()
        expired = [s for s in self._sessions.values() if self._expired(s, now)]
        for session in expired:
            self._drop(session)
        return expired

    def _expired(self, session: Session, now: float) -> bool:
        return not session.busy and now - session.last_used_at > session.idle_ttl_s

    def _release_kv(self, session: Session) -> None:
        if self._on_forget is not None:
            self._on_forget(session.session_id)
        if self._on_evict is not None and (session.kv is not None or session.committing):
            self._on_evict(session)
        session.kv = None
        session.kv_len = 0

    def _drop(self, session: Session) -> None:
        self._release_kv(session)
        self._sessions.pop(session.session_id, None)

    @staticmethod
    def info(session: Session) -> SessionInfo:
        return SessionInfo(
            session_id=session.session_id,
            created_at=session.created_at,
            last_used_at=session.last_used_at,
            idle_ttl_s=session.idle_ttl_s,
            history_tokens=len(session.history),
            turns=session.turns,
            busy=session.busy,
            metadata=dict(session.metadata),
            last_token_id=session.history[-1] if session.history else None,
            context_overflow=session.context_overflow,
            dropped_tokens=session.dropped_tokens,
        )


def history_end(session: Session, turns: int | None, history_tokens: int | None) -> int:
    """Where a rewind or fork to ``turns`` turns or ``history_tokens`` tokens
    cuts ``session``'s history; INVALID_ARGUMENT past its end."""
    if turns is not None:
        if turns > session.turns:
            raise InvalidArgument(
                f"turns: {turns} is past the end; the session has {session.turns} turns"
            )
        if turns == 0:
            return 0
        if len(session.turn_ends) != session.turns:
            raise InvalidArgument(
                "turns: this session's turn boundaries were not recorded (it was saved by an "
                "older server); give history_tokens instead"
            )
        end = session.turn_ends[turns - 1]
        if end == GONE:
            held = [i + 1 for i, e in enumerate(session.turn_ends) if e != GONE]
            earliest = f"turn {held[0]} is the earliest it holds" if held else "it holds none"
            raise InvalidArgument(
                f"turns: {turns} is no longer held; the session's context window slid past "
                f"its end ({earliest}; 0 empties the history)"
            )
        return end
    if history_tokens is None:
        return len(session.history)
    if history_tokens > len(session.history):
        raise InvalidArgument(
            f"history_tokens: {history_tokens} is past the end; the session holds "
            f"{len(session.history)} tokens"
        )
    return history_tokens


def slide_turn_ends(turn_ends: list[int], slides: list[tuple[int, int]]) -> list[int]:
    """Turn ends (history lengths) after ``slides`` (start, dropped): an end
    past the dropped run moves down with it; one inside it or at its end is
    ``GONE`` (that history is no longer held)."""
    ends = list(turn_ends)
    for start, drop in slides:
        ends = [
            e if e == GONE or e <= start else (e - drop if e > start + drop else GONE) for e in ends
        ]
    return ends


def cut_chunks(chunks: builtins.list[KvLayers], n: int) -> tuple[builtins.list[KvLayers], int]:
    """The first ``n`` tokens of parked KV chunks: whole chunks as they are
    (shared), the one that straddles ``n`` as a copy of its first tokens (a view
    would keep the whole array alive while the parked budget counts the view)."""
    kept: builtins.list[KvLayers] = []
    have = 0  # callers keep None, not [], for no KV
    for chunk in chunks:
        if have >= n:
            break
        size = chunk[0][0].shape[1]
        if have + size <= n:
            kept.append(chunk)
            have += size
        else:
            take = n - have
            kept.append([(k[:, :take].copy(), v[:, :take].copy()) for k, v in chunk])
            have = n
    return kept, have


# -- kvstore records -------------------------------------------------------------


def is_session_id(session_id: str) -> bool:
    """Whether ``session_id`` has the form of an id this service hands out."""
    return _SESSION_ID.fullmatch(session_id) is not None


def record_key(session_id: str, key_id: bytes) -> bytes:
    """The kvstore key of a session's record: ``session:`` and a digest of the
    id keyed by the integrity key id (``KvIntegrity.key_id``), so replicas with
    another secret never see it and the store never holds the id (a bearer secret)."""
    digest = hashlib.blake2b(session_id.encode(), key=key_id, digest_size=16).hexdigest()
    return b"session:" + digest.encode()


def _id_digest(session_id: str) -> str:
    return hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()


def closed_record(session: Session) -> bytes:
    """What a closed session's record becomes: a tombstone with the next
    version, so that a replica still holding the session in memory drops it
    (a deleted record would look like one the store evicted)."""
    record = {
        "v": 2,
        "session_digest": _id_digest(session.session_id),
        "closed": True,
        "version": session.version + 1,
    }
    return json.dumps(record).encode()


def session_record(session: Session) -> bytes:
    """A session's persisted state (no KV, no turn in flight) as a record."""
    record = {
        "v": 2,
        # The id is a bearer secret: the record names it by digest only.
        "session_digest": _id_digest(session.session_id),
        "owner": session.owner,
        "created_at": session.created_at,
        "last_used_at": session.last_used_at,
        "idle_ttl_s": session.idle_ttl_s,
        "turns": session.turns,
        "turn_ends": session.turn_ends,
        "version": session.version,
        "metadata": session.metadata,
        "history": session.history,
        "context_overflow": session.context_overflow,
        "dropped_tokens": session.dropped_tokens,
        "lineage": session.lineage.hex(),
        "mirostat_mu": session.mirostat_mu,
    }
    return json.dumps(record).encode()


def _overflow(value: object) -> str:
    if value not in CONTEXT_OVERFLOWS:
        raise ValueError(f"context_overflow {value!r}")
    return str(value)


def _mu(value: object) -> float | None:
    if value is None:
        return None
    mu = float(value)  # type: ignore[arg-type]
    if not math.isfinite(mu):
        raise ValueError(f"mirostat_mu {value!r}")
    return mu


def session_from_record(session_id: str, data: bytes, vocab_size: int) -> Session | None:
    """The session stored in ``data``, or None if the record is unreadable, belongs
    to another id, or holds tokens outside ``[0, vocab_size)``."""
    try:
        rec = json.loads(data)
        if rec.get("closed") is True and rec["session_digest"] == _id_digest(session_id):
            return Session(
                session_id, 0.0, 0.0, 1.0, version=int(rec.get("version", 0)), closed=True
            )
        history = [int(t) for t in rec["history"]]
        if rec["session_digest"] != _id_digest(session_id) or any(
            not 0 <= t < vocab_size for t in history
        ):
            raise ValueError("record does not match")
        return Session(
            session_id=session_id,
            created_at=float(rec["created_at"]),
            last_used_at=time.time(),
            idle_ttl_s=float(rec["idle_ttl_s"]),
            owner=str(rec.get("owner", "")),
            metadata={str(k): str(v) for k, v in rec.get("metadata", {}).items()},
            history=history,
            turns=int(rec.get("turns", 0)),
            turn_ends=[int(e) for e in rec.get("turn_ends", [])],
            version=int(rec.get("version", 0)),
            context_overflow=_overflow(rec.get("context_overflow", "error")),
            dropped_tokens=int(rec.get("dropped_tokens", 0)),
            lineage=bytes.fromhex(str(rec.get("lineage", ""))),
            mirostat_mu=_mu(rec.get("mirostat_mu")),
        )
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("session_record_unreadable", error=str(exc))
        return None
