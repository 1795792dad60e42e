from __future__ import annotations

import pytest

from genai_common.errors import ResourceExhausted
from genai_service.config import SchedulerConfig
from genai_service.contract.request import Priority
from genai_service.engine.scheduler import Scheduler
from genai_service.engine.sequence import SeqStatus, Sequence
from tests.factories import make_sequence


def make_seq(rid: str, n_prompt: int, priority: Priority = Priority.NORMAL) -> Sequence:
    return make_sequence(range(n_prompt), request_id=rid, priority=priority)


def advance(batch_items) -> None:
    """What the engine does after a step: computed tokens, and a sample at the end."""
    for seq, n in batch_items:
        seq.num_computed += n
        if seq.num_pending == 0:
            seq.token_ids.append(0)
            seq.output_ids.append(0)


def test_chunked_prefill_within_budget_and_decodes_keep_running() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    a, b = make_seq("a", 3), make_seq("b", 20)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 3), ("b", 5)]
    advance(batch.items)
    batch = sched.schedule()
    # a decodes (1 token), b's prefill continues with the rest of the budget
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("b", 7)]
    advance(batch.items)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("b", 7)]
    advance(batch.items)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("b", 1)]


def test_priority_then_fcfs_and_max_num_seqs() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100))
    low = make_seq("low", 2, Priority.LOW)
    n1 = make_seq("n1", 2)
    high = make_seq("high", 2, Priority.HIGH)
    n2 = make_seq("n2", 2)
    for s in (low, n1, high, n2):
        sched.add(s)
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.items] == ["high", "n1"]
    assert [s.request_id for s in sched.waiting()] == ["n2", "low"]
    sched.remove(high)
    advance(batch.items)
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.items] == ["n1", "n2"]


def test_queue_bound_and_remove_waiting() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4, max_queue=2))
    a, b = make_seq("a", 2), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    with pytest.raises(ResourceExhausted, match="limit is 2"):
        sched.add(make_seq("c", 2))
    sched.remove(a)
    assert sched.num_waiting == 1
    sched.add(make_seq("c", 2))


def test_admit_hook_can_defer_and_attach_reused_kv() -> None:
    deferred = {"a"}

    def admit(seq: Sequence) -> bool:
        if seq.request_id in deferred:
            return False
        seq.num_computed = 4  # e.g. a prefix hit
        return True

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100), admit=admit)
    a, b = make_seq("a", 6), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("b", 2)]
    assert a.status is SeqStatus.WAITING and sched.num_waiting == 1
    deferred.clear()
    batch = sched.schedule()
    assert ("a", 2) in [(s.request_id, n) for s, n in batch.items]
