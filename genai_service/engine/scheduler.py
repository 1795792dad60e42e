"""Continuous batching: which tokens of which sequences the next step computes.

Each step decodes every running sequence (one token each) and spends what is
left of the token budget on prefill, chunk by chunk, so a long prompt never
stalls running streams for more than one budget's worth of compute. Waiting
requests join between steps in priority order (FCFS within a class). Plain
Python; never imports onnxruntime.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from genai_common.errors import ResourceExhausted

from ..config import SchedulerConfig
from .sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    """What one step computes: ``(sequence, number of its pending tokens)``.

    Decodes (one token each) come first, then prefill chunks.
    """

    items: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        admit: Callable[[Sequence], bool] | None = None,
    ) -> None:
        """``admit(seq)`` is called before a waiting sequence starts running; it
        may attach reused KV (advancing ``num_computed``) or return False to
        leave the sequence waiting this step (e.g. its session's KV is busy)."""
        self.config = config
        self._admit = admit or (lambda seq: True)
        self._waiting: list[tuple[tuple[int, float, int], Sequence]] = []
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self._waiting) >= self.config.max_queue:
            raise ResourceExhausted(
                f"queue: {len(self._waiting)} requests waiting, the limit is "
                f"{self.config.max_queue}; retry later"
            )
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority_key, seq))

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or finish)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            kept = [item for item in self._waiting if item[1] is not seq]
            if len(kept) != len(self._waiting):
                self._waiting = kept
                heapq.heapify(self._waiting)

    def waiting(self) -> list[Sequence]:
        return [seq for _, seq in sorted(self._waiting)]

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        prefilling: list[Sequence] = []
        for seq in self.running:
            if seq.num_pending == 1:
                batch.items.append((seq, 1))
                budget -= 1
            else:
                prefilling.append(seq)
        for seq in prefilling:
            if budget <= 0:
                break
            n = seq.next_chunk(budget)
            batch.items.append((seq, n))
            budget -= n
        deferred: list[tuple[tuple[int, float, int], Sequence]] = []
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            item = heapq.heappop(self._waiting)
            seq = item[1]
            if not self._admit(seq):
                deferred.append(item)
                continue
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = seq.next_chunk(budget)
            batch.items.append((seq, n))
            budget -= n
        for item in deferred:
            heapq.heappush(self._waiting, item)
        return batch
