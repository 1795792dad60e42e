"""Our engine, in-process and through ``genai-server`` (client-side timing).

Timing rules, the same for every engine: the clock starts when the request is
submitted; TTFT is the arrival of the first token; decode tok/s is
``(n - 1) / (t_last - t_first)`` (see ``workload.stream_stats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from genai_client import AsyncClient, Client
from genai_service.config import EngineConfig, RunnerConfig, SchedulerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine

from .procs import REPO, RssMonitor, engine_pids, free_port, log_tail, stop_tree, wait_serving
from .workload import stream_stats

# Server defaults (genai-server --max-num-seqs / --max-batched-tokens), used in-process too.
MAX_NUM_SEQS = 8
MAX_BATCHED_TOKENS = 512

_ids = itertools.count()


class InProcessEngine:
    """``LLMEngine`` driven step by step in this process, as the engine process does."""

    def __init__(self, model_dir: str, threads: int) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model_dir=model_dir,
                runner=RunnerConfig(intra_op_threads=threads),
                scheduler=SchedulerConfig(
                    max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS
                ),
            )
        )
        self.runner_kind = self.engine.runner.kind

    def single(self, ids: Sequence[int], new_tokens: int) -> dict:
        request = GenerationRequest(
            request_id=f"bench-{next(_ids)}",
            prompt_token_ids=tuple(ids),
            stopping=StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
        )
        times: list[float] = []
        counts: list[int] = []
        tokens: list[int] = []
        submit = time.perf_counter()
        self.engine.add_request(request)
        done = False
        with self._settled([request.request_id]):
            while not done:
                outputs = self.engine.step()
                now = time.perf_counter()
                for out in outputs:
                    if out.request_id != request.request_id:
                        continue
                    if out.error is not None:
                        raise out.error
                    if out.token_ids:
                        times.append(now)
                        counts.append(len(out.token_ids))
                        tokens.extend(out.token_ids)
                    done = done or out.finished
        stats = stream_stats(submit, times, counts)
        stats["token_ids"] = tokens[:32]
        return stats

    def concurrent(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict:
        """All prompts added at once, then stepped until every one finished."""
        requests = [
            GenerationRequest(
                request_id=f"bench-{next(_ids)}",
                prompt_token_ids=tuple(ids),
                stopping=StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            )
            for ids in prompts
        ]
        streams = {r.request_id: {"first": 0.0, "last": 0.0, "tokens": 0} for r in requests}
        open_ids = set(streams)
        submit = time.perf_counter()
        for request in requests:
            self.engine.add_request(request)
        with self._settled(list(open_ids)):
            while open_ids:
                outputs = self.engine.step()
                now = time.perf_counter()
                for out in outputs:
                    s = streams.get(out.request_id)
                    if s is None:
                        continue
                    if out.error is not None:
                        raise out.error
                    if out.token_ids:
                        s["first"] = s["first"] or now
                        s["last"] = now
                        s["tokens"] += len(out.token_ids)
                    if out.finished:
                        open_ids.discard(out.request_id)
        return {"submit": submit, "streams": list(streams.values())}

    @contextlib.contextmanager
    def _settled(self, request_ids: Sequence[str]) -> Iterator[None]:
        """Leave the engine idle afterwards: on an error the requests still
        running are aborted (bench.run goes on to the next section, which must
        not share the engine with them); then it steps until nothing is left
        (session-free requests leave nothing but a commit-free retire)."""
        try:
            yield
        except BaseException:
            for rid in request_ids:
                self.engine.abort(rid)
            raise
        finally:
            while self.engine.has_unfinished():
                self.engine.step()


class ServerProcess:
    """``genai-server`` on a free 127.0.0.1 port, with its RSS watched from start to stop."""

    def __init__(
        self,
        model_dir: str,
        threads: int,
        start_timeout_s: float = 600.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="bench-server-", suffix=".log", delete=False
        )
        exe = Path(sys.executable).with_name("genai-server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "genai_service"]
        cmd += [
            "--model", model_dir,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--threads", str(threads),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-batched-tokens", str(MAX_BATCHED_TOKENS),
            "--grace-period", "5",
            *extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.monitor = RssMonitor(self.proc.pid)
        try:
            self._wait_serving(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def cpu_groups(self) -> dict[str, list[int]]:
        """The server's processes for ``procs.ProcCpu``: the frontend and the engine."""
        return {"frontend": [self.proc.pid], "engine": engine_pids(self.proc.pid)}

    def _wait_serving(self, timeout_s: float) -> None:
        try:
            wait_serving(self.target, self.proc, timeout_s)
        except RuntimeError:
            raise RuntimeError(f"genai-server exited early:\n{self.log_tail()}") from None
        except TimeoutError:
            raise TimeoutError(
                f"genai-server not SERVING after {timeout_s}s:\n{self.log_tail()}"
            ) from None

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self._log.name, lines)

    def stop(self) -> dict:
        """Stop the server; returns its peak RSS figures (read just before stopping)."""
        hwm = self.monitor.hwm()
        self.monitor.stop()
        stop_tree(self.proc, timeout_s=15)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        return self.monitor.summary(hwm)


# -- through the server ----------------------------------------------------------


def server_single(
    client: Client, ids: Sequence[int], new_tokens: int, sampling: dict | None = None
) -> dict:
    """One GenerateStream call; ``sampling``: ``SamplingParams`` fields as client
    keyword arguments (``workload.Sampling.params`` plus ``seed``), None: greedy."""
    times: list[float] = []
    counts: list[int] = []
    tokens: list[int] = []
    submit = time.perf_counter()
    stream = client.stream(
        token_ids=list(ids), max_new_tokens=new_tokens, ignore_eos=True, **(sampling or {})
    )
    for delta in stream:
        if delta.token_ids:
            times.append(time.perf_counter())
            counts.append(len(delta.token_ids))
            tokens.extend(delta.token_ids)
    stats = stream_stats(submit, times, counts)
    stats["token_ids"] = tokens[:32]
    stats["cached_tokens"] = stream.result.usage.cached_tokens
    return stats


def server_sessions(
    client: Client, conversations: Sequence[Sequence[Sequence[int]]], new_tokens: int
) -> list[list[dict]]:
    """Run the conversations turn by turn, interleaved (conversation 0's turn 1,
    conversation 1's turn 1, ...); returns per conversation, per turn: TTFT and
    the tokens the server reused."""
    sessions = [client.session() for _ in conversations]
    results: list[list[dict]] = [[] for _ in conversations]
    try:
        for turn in range(len(conversations[0])):
            for c, conv in enumerate(conversations):
                first = None
                submit = time.perf_counter()
                stream = sessions[c].stream(
                    token_ids=list(conv[turn]), max_new_tokens=new_tokens, ignore_eos=True
                )
                for delta in stream:
                    if delta.token_ids and first is None:
                        first = time.perf_counter()
                usage = stream.result.usage
                results[c].append(
                    {
                        "ttft_s": (first or float("nan")) - submit,
                        "prompt_tokens": usage.prompt_tokens,
                        "cached_tokens": usage.cached_tokens,
                        "tokens": usage.completion_tokens,
                    }
                )
    finally:
        for s in sessions:
            s.close()
    return results


async def _concurrent(
    target: str,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    sampling: Sequence[dict | None] | None,
) -> dict:
    per_prompt = list(sampling) if sampling is not None else [None] * len(prompts)
    async with AsyncClient(target) as client:
        await client.model_info()  # connect before the clock starts

        async def one(ids: Sequence[int], params: dict | None) -> dict:
            first = last = 0.0
            n = 0
            stream = client.stream(
                token_ids=list(ids), max_new_tokens=new_tokens, ignore_eos=True, **(params or {})
            )
            async for delta in stream:
                if delta.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    n += len(delta.token_ids)
            return {"first": first, "last": last, "tokens": n}

        submit = time.perf_counter()
        streams = await asyncio.gather(
            *(one(p, params) for p, params in zip(prompts, per_prompt, strict=True))
        )
    return {"submit": submit, "streams": list(streams)}


def server_concurrent(
    target: str,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    sampling: Sequence[dict | None] | None = None,
) -> dict:
    """All prompts submitted at once as separate GenerateStream calls;
    ``sampling`` per prompt as for ``server_single`` (None: all greedy)."""
    return asyncio.run(_concurrent(target, prompts, new_tokens, sampling))


def server_concurrent_go(
    binary: str,
    target: str,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    sampling: Sequence[dict | None] | None = None,
) -> dict:
    """``server_concurrent`` driven by the Go client (``clients/go/cmd/genai-bench``,
    one goroutine per stream) instead of this process's asyncio client; the result
    has the same shape, plus the Go process's CPU seconds (``client_cpu_s``)."""
    per_prompt = list(sampling) if sampling is not None else [None] * len(prompts)
    plan = [
        {"token_ids": list(p), "max_new_tokens": new_tokens, **(params or {})}
        for p, params in zip(prompts, per_prompt, strict=True)
    ]
    done = subprocess.run(
        [binary, "-target", target],
        input=json.dumps(plan),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{binary} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    out = json.loads(done.stdout)
    errors = [s["error"] for s in out["streams"] if s.get("error")]
    if errors:
        raise RuntimeError(f"{binary}: {len(errors)} stream(s) failed, first: {errors[0]}")
    streams = [
        {"first": s["first_s"], "last": s["last_s"], "tokens": s["tokens"]} for s in out["streams"]
    ]
    # Times are seconds from the Go process's own submit instant.
    return {"submit": 0.0, "streams": streams, "client_cpu_s": out["cpu_s"]}
