"""Three replicas, each with a sidecar kvstore, sharing one Redis Cluster
(bench/fleet.py): what one replica stores another reuses, sessions continue on
any replica with one server's tokens, and losing Redis fails no request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fleet import Fleet, affinity, round_robin, run_sessions
from bench.redis_procs import RedisClusterNodes
from genai_client import Client
from tests.conftest import require_tool

pytestmark = pytest.mark.e2e

SESSIONS, TURNS, NEW_TOKENS = 12, 5, 8
SERVER_ARGS = ("--kv-chunk-size", "4", "--max-sessions", "32")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    require_tool("redis-server")
    require_tool("redis-cli")
    redis = RedisClusterNodes(tmp_path_factory.mktemp("redis"))
    try:
        yield redis.start()
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def fleet(cluster: RedisClusterNodes, long_context_model_dir: Path) -> Iterator[Fleet]:
    group = Fleet(
        str(long_context_model_dir), 3, redis_url=cluster.url, server_args=SERVER_ARGS
    ).start()
    yield group
    group.stop()


@pytest.fixture(scope="module")
def single(long_context_model_dir: Path) -> Iterator[Fleet]:
    """One server, its sidecar alone (nothing shared): the reference tokens."""
    group = Fleet(str(long_context_model_dir), 1, server_args=SERVER_ARGS).start()
    yield group
    group.stop()


def test_a_prefix_stored_by_one_replica_is_reused_by_another(fleet: Fleet, single: Fleet) -> None:
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen"
    with Client(single.replicas[0].target, timeout=60) as c:
        expected = c.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
    a, b = (Client(r.target, timeout=60) for r in fleet.replicas[:2])
    with a, b:
        first = a.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        # B's own sidecar never saw the prompt: its chunks come from Redis.
        reused = None
        for _ in range(50):  # A pushes its chunks in the background
            reused = b.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            if reused.usage.cached_tokens:
                break
        assert reused is not None and reused.usage.cached_tokens > 0
        assert first.token_ids == reused.token_ids == expected


def test_sessions_continue_on_any_replica_with_one_servers_tokens(
    fleet: Fleet, single: Fleet
) -> None:
    one = run_sessions([single.replicas[0].target], affinity, SESSIONS, TURNS, NEW_TOKENS)
    targets = [r.target for r in fleet.replicas]
    sticky = run_sessions(targets, affinity, SESSIONS, TURNS, NEW_TOKENS)
    spread = run_sessions(targets, round_robin, SESSIONS, TURNS, NEW_TOKENS)
    assert sticky.tokens() == one.tokens()
    assert spread.tokens() == one.tokens()
    # Round robin: every turn after the first ran where the session had been
    # (stale copy, replaced by the newer record) or had never been (restored).
    assert {t.replica for t in spread.turns if t.session == 0} == {0, 1, 2}
    assert sum(fleet.engine_stats("sessions_replaced")) > 0
    assert sum(fleet.engine_stats("sessions_restored")) > 0
    # Each turn reuses the whole history, from memory or from the shared tier.
    for run in (sticky, spread):
        for turn in run.turns:
            if turn.turn > 0:
                assert turn.cached_tokens > 0, turn


def test_losing_redis_fails_no_request(
    fleet: Fleet, single: Fleet, cluster: RedisClusterNodes
) -> None:
    """One shard killed, then the whole cluster: sessions (kept on their replica)
    and plain requests still succeed with one server's tokens; misses counted."""
    targets = [r.target for r in fleet.replicas]
    one = run_sessions([single.replicas[0].target], affinity, 6, 3, NEW_TOKENS)
    before = [s.errors for s in fleet.redis_stats() if s is not None]
    assert len(before) == 3
    cluster.nodes[1].kill()
    assert run_sessions(targets, affinity, 6, 3, NEW_TOKENS).tokens() == one.tokens()
    cluster.stop()
    assert run_sessions(targets, affinity, 6, 3, NEW_TOKENS).tokens() == one.tokens()
    prompt = "a red hat on the big dog in the old house by the small tree"
    with Client(single.replicas[0].target, timeout=60) as c:
        expected = c.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
    for target in targets:
        with Client(target, timeout=60) as c:
            result = c.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert result.token_ids == expected
    # Every Redis failure was a miss or a write kept locally, and counted.
    after = [s.errors for s in fleet.redis_stats() if s is not None]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
