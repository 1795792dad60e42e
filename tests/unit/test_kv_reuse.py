"""KV reuse without a model: a dict-backed runner, the in-memory kvstore, session records."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np

from genai_service.engine.kv.kv_connector_memory import MemoryKvChunkStore
from genai_service.engine.kv.prefix_cache import KvLayers, chunk_keys, join_chunks, kv_nbytes
from genai_service.engine.kv_reuse import KvReuse
from genai_service.engine.sequence import Sequence
from genai_service.engine.sessions.sessions import (
    Session,
    is_session_id,
    record_key,
    session_from_record,
    session_record,
)
from tests.factories import make_sequence

CHUNK = 4
NS = b"test-namespace"


class DictRunner:
    """The KV half of ``ModelRunner``: token ``t`` at any position has K = t, V = -t."""

    kind = "dict"

    def __init__(self) -> None:
        self.kv: dict[int, KvLayers] = {}

    def compute(self, seq: Sequence, n: int) -> None:
        ids = np.asarray(seq.token_ids[:n], np.float32)
        k = np.broadcast_to(ids[None, :, None], (2, n, 3)).copy()
        self.kv[seq.seq_id] = [(k, -k), (k + 1, -k - 1)]

    def kv_len(self, seq_id: int) -> int:
        layers = self.kv.get(seq_id)
        return 0 if not layers else int(layers[0][0].shape[1])

    def read_kv(self, seq_id: int, start: int, end: int) -> KvLayers:
        return [(k[:, start:end].copy(), v[:, start:end].copy()) for k, v in self.kv[seq_id]]

    def write_kv(self, seq_id: int, layers: KvLayers) -> None:
        assert not self.kv_len(seq_id)
        self.kv[seq_id] = [(k.copy(), v.copy()) for k, v in layers]

    def write_chunks(self, seq_id: int, chunks: list[KvLayers]) -> None:
        self.write_kv(seq_id, join_chunks(chunks))


def make_seq(ids: list[int], session: Session | None = None) -> Sequence:
    return make_sequence(ids, session=session)


def make_reuse(
    runner: DictRunner, capacity: int = 1 << 20, remote: MemoryKvChunkStore | None = None
) -> KvReuse:
    return KvReuse(runner, NS, CHUNK, capacity, remote, Counter())  # type: ignore[arg-type]


PROMPT = list(range(1, 12))  # 11 tokens: two complete chunks of the first 10


def computed(runner: DictRunner, reuse: KvReuse) -> Sequence:
    """A sequence whose prompt was computed and stored, as the engine does."""
    seq = make_seq(PROMPT)
    runner.compute(seq, len(PROMPT))
    seq.num_computed = len(PROMPT)
    reuse.store(seq)
    return seq


def test_module_does_not_import_onnxruntime() -> None:
    code = "import sys, genai_service.engine.kv_reuse; print('onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stored_chunks_are_attached_to_a_later_prompt_with_the_same_prefix() -> None:
    runner = DictRunner()
    reuse = make_reuse(runner)
    first = computed(runner, reuse)
    assert first.stored_chunks == 2 and len(reuse.prefix_index) == 2
    second = make_seq(PROMPT + [99])
    assert reuse.attach(second)
    assert second.num_computed == second.num_cached == second.stored_chunks * CHUNK == 8
    np.testing.assert_array_equal(
        runner.kv[second.seq_id][1][0], runner.read_kv(first.seq_id, 0, 8)[1][0]
    )
    assert reuse.counters == Counter(prefix_cached_tokens=8)


def test_the_last_prompt_token_is_always_left_to_compute() -> None:
    runner = DictRunner()
    reuse = make_reuse(runner)
    computed(runner, reuse)
    # two whole chunks: both are reused but for the last position, whose
    # logits are needed, so exactly one token is left to compute
    exact = make_seq(PROMPT[:8])
    assert reuse.attach(exact) and exact.num_cached == 7 and exact.num_pending == 1
    np.testing.assert_array_equal(runner.kv[exact.seq_id][0][0][0, :, 0], PROMPT[:7])


def test_no_capacity_and_no_store_means_no_reuse() -> None:
    runner = DictRunner()
    reuse = make_reuse(runner, capacity=0)
    first = computed(runner, reuse)
    assert first.stored_chunks == 0 and len(reuse.prefix_index) == 0
    second = make_seq(PROMPT)
    assert reuse.attach(second) and second.num_cached == 0 and not reuse.counters


def test_chunks_come_back_from_the_kvstore_on_another_replica() -> None:
    store = MemoryKvChunkStore()
    runner_a, runner_b = DictRunner(), DictRunner()
    a = make_reuse(runner_a, remote=store)
    first = computed(runner_a, a)
    assert store.stats()["pushed_chunks"] == 2
    b = make_reuse(runner_b, remote=store)
    seq = make_seq(PROMPT)
    b.start_prefetch(seq)
    assert seq.prefetch is not None and seq.prefetch_from == 0
    assert b.attach(seq) and seq.num_cached == 8 and seq.prefetch is None
    for (k, v), (k0, v0) in zip(
        runner_b.kv[seq.seq_id], runner_a.read_kv(first.seq_id, 0, 8), strict=True
    ):
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)
    assert b.counters == Counter(kvstore_cached_tokens=8)
    assert len(b.prefix_index) == 2  # fetched chunks are kept locally too


def test_a_pending_prefetch_holds_admission() -> None:
    store = MemoryKvChunkStore(delay_s=0.5, timeout_s=5.0)
    reuse = make_reuse(DictRunner(), remote=store)
    seq = make_seq(PROMPT)
    reuse.start_prefetch(seq)
    assert not reuse.attach(seq)
    store.close()  # resolves the prefetch with nothing
    assert reuse.attach(seq) and seq.num_cached == 0


def test_session_kv_comes_first_and_waits_for_a_commit() -> None:
    runner = DictRunner()
    reuse = make_reuse(runner)
    donor = make_seq(PROMPT)
    runner.compute(donor, 6)
    session = Session("s" * 32, 0.0, 0.0, 10.0, history=PROMPT[:6])
    session.committing = True
    seq = make_seq(PROMPT, session)
    assert not reuse.attach(seq)
    session.committing = False
    session.kv, session.kv_len = [runner.read_kv(donor.seq_id, 0, 6)], 6
    assert reuse.attach(seq) and seq.num_cached == 6 and session.kv is None
    assert reuse.counters == Counter(session_cached_tokens=6)


def test_a_snapshot_shares_indexed_chunks_and_copies_the_rest() -> None:
    runner = DictRunner()
    reuse = make_reuse(runner)
    seq = computed(runner, reuse)  # chunks 0 and 1 are in the index
    first = chunk_keys(NS, PROMPT, CHUNK)[0]
    reuse.prefix_index._entries.pop(first)  # as if evicted: chunk 0 must be copied
    parked = reuse.snapshot(seq, 11)
    assert [c[0][0].shape[1] for c in parked] == [4, 4, 3]  # copy, shared, tail copy
    assert parked[1] is reuse.prefix_index.get(chunk_keys(NS, PROMPT, CHUNK)[1])
    assert not any(np.shares_memory(parked[0][0][0], k) for k, _ in runner.kv[seq.seq_id])
    np.testing.assert_array_equal(
        join_chunks(parked)[1][1], runner.read_kv(seq.seq_id, 0, 11)[1][1]
    )
    # without an index everything is one copy
    bare = make_reuse(runner, capacity=0)
    assert [c[0][0].shape[1] for c in bare.snapshot(seq, 11)] == [11]


def test_join_chunks_keeps_order() -> None:
    one = [(np.full((2, 4, 3), 1.0), np.full((2, 4, 3), -1.0))]
    two = [(np.full((2, 4, 3), 2.0), np.full((2, 4, 3), -2.0))]
    joined = join_chunks([one, two, two])
    assert joined[0][0].shape == (2, 12, 3) and kv_nbytes(joined) == 3 * kv_nbytes(one)
    assert joined[0][0][0, :, 0].tolist() == [1.0] * 4 + [2.0] * 8
    assert join_chunks([two])[0][1][0, 0, 0] == -2.0


def test_store_keys_follow_the_chunk_chain() -> None:
    runner = DictRunner()
    reuse = make_reuse(runner)
    computed(runner, reuse)
    assert all(k in reuse.prefix_index for k in chunk_keys(NS, PROMPT, CHUNK))


def test_session_record_round_trip_and_rejections() -> None:
    sid = "0123456789abcdef" * 2
    assert is_session_id(sid) and not is_session_id(sid.upper()) and not is_session_id(sid + "0")
    # The key names neither the id (a bearer secret) nor the same entry under another secret.
    key = record_key(sid, bytes(16))
    assert key.startswith(b"session:") and sid.encode() not in key
    assert key == record_key(sid, bytes(16)) != record_key(sid, bytes([1] * 16))
    session = Session(sid, 1.5, 2.5, 30.0, "alice", {"k": "v"}, [1, 2, 3], turns=2)
    data = session_record(session)
    assert sid.encode() not in data  # the store never holds the id, even inside the record
    back = session_from_record(sid, data, vocab_size=4)
    assert back is not None
    assert (back.created_at, back.idle_ttl_s, back.owner, back.metadata) == (
        1.5,
        30.0,
        "alice",
        {"k": "v"},
    )
    assert (back.history, back.turns, back.kv) == ([1, 2, 3], 2, None)
    assert session_from_record(sid, data, vocab_size=3) is None  # token 3 out of vocab
    assert session_from_record("f" * 32, data, vocab_size=4) is None  # another id
    assert session_from_record(sid, b"not json", vocab_size=4) is None
    assert session_from_record(sid, json.dumps({"session_digest": sid}).encode(), 4) is None
