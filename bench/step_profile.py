"""Where a decode step's time goes in the engine process (issue 14: engine-loop Python).

Runs ``LLMEngine`` in this process on a model (the default one unless
``--model``), brings ``--batch`` greedy streams to steady decode, then times
``--steps`` steps twice:

1. bare: only the ONNX Runtime call (``session.run_with_iobinding`` /
   ``session.run``) and the sampler (``TokenPicker.pick``) are timed; the
   "engine loop" is the rest of ``LLMEngine.step`` (the issue's "engine-loop
   Python per decode step"). Sending the step's ``Outputs`` down a real pipe
   through the engine process's own ``Outbox`` (the pickle on the loop, the
   write too while the pipe has room) is timed apart.
2. probed: each stage wrapped in a timer (exclusive times; the probes cost
   a little themselves), for the breakdown table.

Times are this thread's CPU time (``time.thread_time``), so preemption by
other processes is not counted (cold caches after an ONNX Runtime call are);
medians over steps. On a shared machine they are still noisy.

    python -m bench.step_profile [--model DIR] [--batch 1 8] [--steps 300]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from genai_service.config import EngineConfig, RunnerConfig, SchedulerConfig
from genai_service.contract.protocol import Outputs
from genai_service.contract.request import GenerationRequest, SamplingParams, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.process_main import Outbox
from genai_service.engine.text import detokenizer, stops, text_output

from .workload import SAMPLINGS


class Probes:
    """Exclusive time per named stage, per step (a timer stack), on ``clock``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.step: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, time in children]

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [self.clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                total = self.clock() - frame[0]
                self.step[name] = self.step.get(name, 0.0) + total - frame[1]
                if self._stack:
                    self._stack[-1][1] += total

        setattr(owner, attr, timed)

    @contextmanager
    def top(self, name: str) -> Iterator[None]:
        frame = [self.clock(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            total = self.clock() - frame[0]
            self.step[name] = self.step.get(name, 0.0) + total - frame[1]


def _drain(conn: Any) -> None:
    while conn.recv_bytes():
        pass


def _engine(model_dir: str, threads: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            runner=RunnerConfig(intra_op_threads=threads),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        )
    )


def _start(
    engine: LLMEngine, batch: int, new_tokens: int, tag: str, sampling: str = "greedy"
) -> None:
    """``batch`` streams of a 64-token prompt (``sampling``: a key of
    ``workload.SAMPLINGS``), stepped until all decode."""
    params = SamplingParams(**SAMPLINGS[sampling].params())
    for i in range(batch):
        prompt = tuple(100 + (7 * i + j) % 5000 for j in range(64))
        engine.add_request(
            GenerationRequest(
                f"{tag}-{i}",
                prompt,
                sampling=replace(params, seed=i) if not params.greedy else params,
                stopping=StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            )
        )
    while any(s.num_pending > 1 or not s.output_ids for s in engine.scheduler.running) or (
        engine.scheduler.num_waiting
    ):
        engine.step()


def _finish(engine: LLMEngine) -> None:
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()


def measure(
    engine: LLMEngine,
    batch: int,
    steps: int,
    send: Callable[[Any], None],
    probed: bool,
    clock: Callable[[], float] = time.thread_time,
    sampling: str = "greedy",
) -> list[dict[str, float]]:
    """Per-step stage times (seconds, on ``clock``) of ``steps`` steady decode steps."""
    probes = Probes(clock)
    runner, picker = engine.runner, engine.picker
    session = runner.session  # type: ignore[attr-defined]
    # What each wrapped attribute was in the object's own namespace (None:
    # not set there, the class's method showed through).
    saved: dict[tuple[Any, str], Any] = {
        (obj, attr): vars(obj).get(attr)
        for obj, attr in [(session, "run_with_iobinding"), (session, "run"), (picker, "pick")]
    }
    probes.wrap(session, "run_with_iobinding", "ort")
    probes.wrap(session, "run", "ort")
    probes.wrap(picker, "pick", "sampler")
    classes: list[tuple[Any, str, str]] = []
    if probed:
        classes = [
            (text_output.TextOutput, "add", "text_output"),
            (detokenizer.IncrementalDetokenizer, "add", "detokenizer"),
            (stops.StopStringMatcher, "feed", "stop_matcher"),
        ]
        for obj, attr, name in [
            (engine, "_housekeeping", "housekeeping"),
            (engine.scheduler, "schedule", "schedule"),
            (engine, "_run", "run_prepare"),
            (runner, "run", "runner"),
            (engine, "_postprocess", "postprocess"),
            (engine, "_append_token", "append_token"),
        ]:
            saved[(obj, attr)] = vars(obj).get(attr)
            probes.wrap(obj, attr, name)
        for cls, attr, name in classes:
            saved[(cls, attr)] = vars(cls).get(attr)
            probes.wrap(cls, attr, name)
    _start(engine, batch, steps + 50, f"b{batch}-{probed}", sampling)
    rows = []
    try:
        for _ in range(steps):
            probes.step = {}
            w0 = time.perf_counter()
            with probes.top("step"):
                outputs = engine.step()
            w1 = time.perf_counter()
            with probes.top("pipe"):
                send(Outputs(tuple(outputs)))
            assert len(outputs) == batch, "not a steady decode step"
            row = dict(probes.step)
            row["wall"] = w1 - w0
            total = sum(row.get(k, 0.0) for k in ORDER if k != "pipe")
            row["loop"] = total - row.get("ort", 0.0) - row.get("sampler", 0.0)
            rows.append(row)
    finally:
        for (obj, attr), fn in saved.items():
            if fn is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
        _finish(engine)
    return rows


ORDER = [
    "ort",
    "sampler",
    "housekeeping",
    "schedule",
    "run_prepare",
    "runner",
    "postprocess",
    "append_token",
    "text_output",
    "detokenizer",
    "stop_matcher",
    "step",
    "pipe",
]
NOTES = {
    "ort": "ONNX Runtime session call",
    "sampler": "TokenPicker.pick (argmax / sampler numpy)",
    "housekeeping": "LLMEngine._housekeeping",
    "schedule": "Scheduler.schedule",
    "run_prepare": "LLMEngine._run (step items, drafts)",
    "runner": "runner.run minus ORT (feeds, binding)",
    "postprocess": "LLMEngine._postprocess (own)",
    "append_token": "LLMEngine._append_token (own: stop rules, RequestOutput)",
    "text_output": "TextOutput.add (own)",
    "detokenizer": "IncrementalDetokenizer.add",
    "stop_matcher": "StopStringMatcher.feed",
    "step": "LLMEngine.step (own: lists, drain)",
    "pipe": "Outputs(...) + the engine's Outbox.send (pickle, poll, write)",
}


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows) * 1e6


def report(batch: int, bare: list[dict[str, float]], probed: list[dict[str, float]]) -> None:
    loop = _median(bare, "loop")
    print(f"\n## batch {batch}: {len(bare)} steps, medians in microseconds per step")
    print(
        f"bare run: step wall {_median(bare, 'wall'):.0f}; CPU of this thread: "
        f"ONNX Runtime call {_median(bare, 'ort'):.0f}, sampler {_median(bare, 'sampler'):.0f}, "
        f"**engine loop {loop:.0f}** ({loop / batch:.1f} per token), "
        f"pipe send {_median(bare, 'pipe'):.0f}"
    )
    print("\n| stage (probed run, exclusive thread CPU) | us/step | |")
    print("|---|---:|---|")
    for key in ORDER:
        print(f"| {key} | {_median(probed, key):.1f} | {NOTES[key]} |")
    print(f"| engine loop (probed: step minus ort, sampler) | {_median(probed, 'loop'):.1f} | |")


def summary(
    model_dir: str | None = None,
    batches: tuple[int, ...] = (1, 8),
    steps: int = 200,
    threads: int = 2,
    reps: int = 2,
) -> dict[str, Any]:
    """For ``bench.run`` (section "step_profile"): per batch, the bare run's
    medians in microseconds per step, and the batch-1 engine loop in ms as
    ``engine_loop_python_ms_per_step`` (issue 14's target)."""
    from genai_service.convert.default_model import resolve_model

    engine = _engine(str(resolve_model(model_dir or "default", progress=False)), threads)
    reader, writer = mp.Pipe(duplex=False)
    drain = mp.get_context("spawn").Process(target=_drain, args=(reader,), daemon=True)
    drain.start()
    outbox = Outbox(writer)  # the engine process's own sender
    out: dict[str, Any] = {"steps": steps, "reps": reps, "threads": threads, "by_batch": {}}
    try:
        for batch in batches:
            bare: list[dict[str, float]] = []
            for _ in range(reps):
                bare += measure(engine, batch, steps, outbox.send, probed=False)
            out["by_batch"][str(batch)] = {
                key: _median(bare, key) for key in ("wall", "ort", "sampler", "loop", "pipe")
            }
    finally:
        outbox.close()
        writer.send_bytes(b"")
        drain.join(5)
        engine.close()
    first = out["by_batch"].get("1")
    if first is not None:
        out["engine_loop_python_ms_per_step"] = first["loop"] / 1000.0
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [
        f"In-process `LLMEngine`, default model, {result['threads']} threads, greedy steady "
        f"decode, {result['reps']} x {result['steps']} steps; this thread's CPU time per "
        "step (medians, microseconds). The engine loop is `LLMEngine.step` minus the ONNX "
        "Runtime call and the sampler; the pipe send (pickle and write) is timed apart: the "
        "engine process's outbox pickles on the loop and writes from it when the pipe has "
        "room (else its thread writes).",
        "",
        "| batch | step wall | ONNX Runtime | sampler | engine loop | pipe send |",
        "|---|---|---|---|---|---|",
    ]
    for batch, row in result["by_batch"].items():
        lines.append(
            f"| {batch} | {row['wall']:.0f} | {row['ort']:.0f} | {row['sampler']:.0f} "
            f"| {row['loop']:.0f} | {row['pipe']:.0f} |"
        )
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model dir, or 'default'")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="bare/probed pairs per batch")
    parser.add_argument("--sampling", default="greedy", choices=sorted(SAMPLINGS))
    parser.add_argument(
        "--no-ort",
        action="store_true",
        help="skip the ONNX Runtime call (meaningless tokens): the loop with warm caches",
    )
    args = parser.parse_args()
    from genai_service.convert.default_model import resolve_model

    engine = _engine(str(resolve_model(args.model, progress=False)), args.threads)
    if args.no_ort:
        engine.runner.session.run_with_iobinding = lambda *a, **k: None  # type: ignore[attr-defined]
    reader, writer = mp.Pipe(duplex=False)
    drain = mp.get_context("spawn").Process(target=_drain, args=(reader,), daemon=True)
    drain.start()
    outbox = Outbox(writer)
    try:
        for batch in args.batch:
            bare: list[dict[str, float]] = []
            probed: list[dict[str, float]] = []
            for _ in range(args.reps):  # interleaved, so drift hits both alike
                bare += measure(
                    engine, batch, args.steps, outbox.send, False, sampling=args.sampling
                )
                probed += measure(
                    engine, batch, args.steps, outbox.send, True, sampling=args.sampling
                )
            report(batch, bare, probed)
    finally:
        outbox.close()
        writer.send_bytes(b"")
        drain.join(5)


if __name__ == "__main__":
    main()
