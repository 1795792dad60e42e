from __future__ import annotations

import base64

import pytest

from genai_common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from genai_service.config import SESSION_LIST_PAGE_BYTES, SessionConfig
from genai_service.contract.sessions import check_metadata
from genai_service.engine.sessions.sessions import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    SessionTable,
    listed_bytes,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_create_get_and_ids_are_128_bit_random() -> None:
    table = SessionTable(max_sessions=4, idle_ttl_s=10)
    a, b = table.create(), table.create()
    assert len(a.session_id) == 32 and a.session_id != b.session_id
    assert table.get(a.session_id) is a


def test_unknown_and_expired_sessions_are_not_found_alike() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=4, idle_ttl_s=10, clock=clock)
    s = table.create()
    clock.now += 11
    with pytest.raises(NotFound) as expired:
        table.get(s.session_id)
    with pytest.raises(NotFound) as unknown:
        table.get("nope")
    assert "no session" in expired.value.message and "no session" in unknown.value.message
    assert len(table) == 0


def test_max_sessions() -> None:
    table = SessionTable(max_sessions=1, idle_ttl_s=10)
    table.create()
    with pytest.raises(ResourceExhausted, match="limit is 1"):
        table.create()


def test_one_turn_at_a_time_and_reset_close() -> None:
    evicted = []
    table = SessionTable(max_sessions=2, idle_ttl_s=10, on_evict=evicted.append)
    s = table.create()
    table.begin_turn(s.session_id, "r1")
    with pytest.raises(FailedPrecondition, match="already running a turn"):
        table.begin_turn(s.session_id, "r2")
    with pytest.raises(FailedPrecondition):
        table.reset(s.session_id)
    table.end_turn(s)
    s.history = [1, 2, 3]
    s.kv, s.kv_len = object(), 3
    table.reset(s.session_id)
    assert s.history == [] and s.kv is None and evicted == [s]
    table.close(s.session_id)
    with pytest.raises(NotFound):
        table.get(s.session_id)


def test_busy_sessions_do_not_expire() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=2, idle_ttl_s=1, clock=clock)
    s = table.create()
    table.begin_turn(s.session_id, "r")
    clock.now += 5
    assert table.get(s.session_id) is s


# -- metadata limits (docs/design.md "Sessions") ------------------------------


def test_metadata_within_the_limits_is_accepted() -> None:
    limits = SessionConfig()
    check_metadata({}, limits)
    # every limit reached exactly: 4 values of 4 KiB minus their keys = 16 KiB in all
    full = {f"k{i}": "v" * (4096 - 2) for i in range(4)}
    assert sum(len(k) + len(v) for k, v in full.items()) == 16 * 1024
    check_metadata(full, limits)
    check_metadata({f"k{i:02}": "" for i in range(64)}, limits)
    check_metadata({"é" * 128: "ü" * 2048}, limits)  # 256 and 4096 UTF-8 bytes


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({str(i): "" for i in range(100_000)}, "metadata: 100000 entries; at most 64 allowed"),
        ({str(i): "" for i in range(65)}, "metadata: 65 entries; at most 64 allowed"),
        ({"k" * 257: "v"}, f"metadata: key {'k' * 32!r}… is 257 bytes; at most 256 allowed"),
        ({"é" * 129: "v"}, f"metadata: key {'é' * 32!r}… is 258 bytes; at most 256 allowed"),
        (
            {"user": "x" * 12_000_000},
            "metadata: the value of key 'user' is 12000000 bytes; at most 4096 allowed",
        ),
        (
            {"user": "x" * 4097},
            "metadata: the value of key 'user' is 4097 bytes; at most 4096 allowed",
        ),
        (
            {f"k{i}": "v" * 4094 for i in range(5)},
            "metadata: 20480 bytes of keys and values; at most 16384 allowed",
        ),
    ],
    ids=["100k-keys", "65-keys", "long-key", "long-utf8-key", "12MB-value", "value", "total"],
)
def test_metadata_over_a_limit_names_field_value_and_limit(
    metadata: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_metadata(metadata, SessionConfig())
    assert err.value.message == message
    assert err.value.field_violation()[0] == "metadata"  # google.rpc.BadRequest's field


def test_metadata_limits_are_configurable_and_validated() -> None:
    small = SessionConfig(max_metadata_entries=1, max_metadata_bytes=8)
    with pytest.raises(InvalidArgument, match="2 entries; at most 1 allowed"):
        check_metadata({"a": "", "b": ""}, small)
    with pytest.raises(InvalidArgument, match="9 bytes of keys and values; at most 8"):
        check_metadata({"abc": "defghi"}, small)
    for field in (
        "max_metadata_entries",
        "max_metadata_key_bytes",
        "max_metadata_value_bytes",
        "max_metadata_bytes",
    ):
        with pytest.raises(ValueError, match=f"{field} must be > 0, got 0"):
            SessionConfig(**{field: 0})
    with pytest.raises(ValueError, match="max_metadata_bytes must be <= 524288"):
        SessionConfig(max_metadata_bytes=SESSION_LIST_PAGE_BYTES)


# -- ListSessions pages (AIP-158) ------------------------------------------------


def paged_table(n: int, clock: Clock, owners: tuple[str, ...] = ("",)) -> SessionTable:
    table = SessionTable(max_sessions=n + 1, idle_ttl_s=1e6, clock=clock)
    for i in range(n):
        clock.now += 1
        table.create(owner=owners[i % len(owners)], metadata={"i": str(i)})
    return table


def all_pages(table: SessionTable, owner: str | None, page_size: int) -> list[list[str]]:
    pages, token = [], ""
    while True:
        sessions, token = table.page(owner, page_size, token)
        pages.append([s.metadata["i"] for s in sessions])
        if not token:
            return pages


def test_pages_in_creation_order_with_tokens_and_an_end() -> None:
    clock = Clock()
    table = paged_table(7, clock)
    assert all_pages(table, None, 3) == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    assert all_pages(table, None, 7) == [[str(i) for i in range(7)]]
    # a session created while paging sorts after those listed: nothing repeats or is skipped
    first, token = table.page(None, 3, "")
    clock.now += 1
    table.create(metadata={"i": "7"})
    table.close(first[0].session_id)
    rest, token = table.page(None, 10, token)
    assert [s.metadata["i"] for s in rest] == ["3", "4", "5", "6", "7"] and token == ""
    # equal creation times: the id breaks the tie, stably
    tied = SessionTable(max_sessions=8, idle_ttl_s=10, clock=lambda: 5.0)
    ids = sorted(tied.create().session_id for _ in range(5))
    pages = [tied.page(None, 2, "")]
    while pages[-1][1]:
        pages.append(tied.page(None, 2, pages[-1][1]))
    assert [s.session_id for p, _ in pages for s in p] == ids and len(pages) == 3


def test_page_size_bounds() -> None:
    clock = Clock()
    table = paged_table(1200, clock)
    assert len(table.page(None, 0, "")[0]) == DEFAULT_PAGE_SIZE == 50
    assert len(table.page(None, 5000, "")[0]) == MAX_PAGE_SIZE == 1000
    assert len(table.page(None, 1, "")[0]) == 1
    with pytest.raises(InvalidArgument) as err:
        table.page(None, -1, "")
    assert err.value.message == "page_size: -1 is negative; allowed [0, 1000] (0: 50)"


@pytest.mark.parametrize(
    "token",
    [
        "garbage",
        "!!!",
        base64.urlsafe_b64encode(b"[1.0]").decode(),
        base64.urlsafe_b64encode(b'[1.0, "not-a-session-id"]').decode(),
        base64.urlsafe_b64encode(b'[true, "' + b"0" * 32 + b'"]').decode(),
        base64.urlsafe_b64encode(b'{"a": 1}').decode(),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
    ],
)
def test_a_bad_page_token_is_invalid_argument(token: str) -> None:
    table = paged_table(2, Clock())
    with pytest.raises(InvalidArgument) as err:
        table.page(None, 1, token)
    assert err.value.message == f"page_token: {token!r} is not a next_page_token of ListSessions"


def test_pages_list_only_the_owners_sessions() -> None:
    table = paged_table(9, Clock(), owners=("alice", "bob", "carol"))
    assert all_pages(table, "alice", 2) == [["0", "3"], ["6"]]
    assert all_pages(table, "bob", 0) == [["1", "4", "7"]]
    assert all_pages(table, "mallory", 0) == [[]]
    # another owner's token is only a position: it never shows anyone else's sessions
    _, bob_token = table.page("bob", 1, "")
    assert [s.owner for s in table.page("alice", 10, bob_token)[0]] == ["alice", "alice"]


def test_a_page_is_bounded_in_bytes_whatever_the_page_size() -> None:
    """The largest page at the default limits: MAX_PAGE_SIZE sessions with the
    most metadata would be ~16 MB; pages stop at SESSION_LIST_PAGE_BYTES."""
    limits = SessionConfig()
    clock = Clock()
    n = 200
    table = SessionTable(max_sessions=n, idle_ttl_s=1e6, clock=clock)
    biggest = {f"{i:03}" + "k" * 253: "v" * 4096 for i in range(3)}  # 13,056 bytes
    biggest["pad"] = "p" * (limits.max_metadata_bytes - 13_056 - 3)
    check_metadata(biggest, limits)  # exactly the total limit
    for _ in range(n):
        clock.now += 1
        table.create(metadata=biggest)
    worst = listed_bytes(table.list()[0])
    assert worst == 100 + limits.max_metadata_bytes + 4 * 12
    assert MAX_PAGE_SIZE * worst > 15 * 1024 * 1024  # why a count alone is no bound
    token, seen, pages = "", 0, 0
    while True:
        sessions, token = table.page(None, MAX_PAGE_SIZE, token)
        assert sessions and sum(map(listed_bytes, sessions)) <= SESSION_LIST_PAGE_BYTES
        seen, pages = seen + len(sessions), pages + 1
        if not token:
            break
    assert seen == n and pages == -(-n // (SESSION_LIST_PAGE_BYTES // worst))
