"""Driving an engine from the calling thread: tests, tools and benchmarks that
run ``LLMEngine`` in-process. The engine process (``process_main``) drives it
from its own loop instead and never blocks on these."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol, TypeVar

from ..contract.request import GenerationRequest, GenerationResult, RequestOutput, collect
from .sessions.restores import PendingCall

T = TypeVar("T")


class _Engine(Protocol):
    """What the driver needs of ``LLMEngine``."""

    last_step_idle: bool

    def add_request(self, request: GenerationRequest) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def flush_finished(self) -> None: ...
    def run_to_completion(
        self, requests: Iterable[GenerationRequest]
    ) -> dict[str, GenerationResult]: ...


class InProcessDriver:
    """``LLMEngine``'s blocking helpers (a mixin: they use only its public steps)."""

    def run_to_completion(
        self: _Engine, requests: Iterable[GenerationRequest]
    ) -> dict[str, GenerationResult]:
        """Add ``requests`` and step until all of them finish (tests, benchmarks)."""
        ids = []
        for request in requests:
            self.add_request(request)
            ids.append(request.request_id)
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        while any(not (o and o[-1].finished) for o in outputs.values()):
            for out in self.step():
                if out.request_id in outputs:
                    outputs[out.request_id].append(out)
            if self.last_step_idle:
                time.sleep(0.001)  # waiting on the kvstore, not on compute
        self.flush_finished()
        return {rid: collect(outs) for rid, outs in outputs.items()}

    def generate(self: _Engine, request: GenerationRequest) -> GenerationResult:
        return self.run_to_completion([request])[request.request_id]

    def wait(self: _Engine, result: T | PendingCall) -> T:
        """The answer of a session call, stepping until a pending one is resolved
        (in-process callers: tests, tools; the engine process answers pending
        calls from its loop instead)."""
        if not isinstance(result, PendingCall):
            return result
        while not result.done:
            self.step()
            if self.last_step_idle:
                time.sleep(0.001)  # waiting on the kvstore
        if not result.ok:
            raise result.value
        return result.value  # type: ignore[no-any-return]
