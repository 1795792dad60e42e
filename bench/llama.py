"""llama.cpp's ``llama-server``, an optional side of the benchmark (issue 14).

``python -m bench.run --llama-server PATH --gguf PATH`` starts the given
binary on the default model's GGUF (``-t`` intra-op threads as every engine,
``-np 8`` slots, a free loopback port) and streams from its HTTP
``/completion`` endpoint with token-id prompts, timed on the client the same
way as ours (``workload.stream_stats``: the clock starts at submit, TTFT is
the first streamed token's arrival, decode is ``(n - 1) / (t_last - t_first)``).
Nothing here builds llama.cpp; without a binary the section is skipped.

Sampling maps onto llama-server's fields with its other samplers off
(``min_p`` 0, whose default is 0.05) and the repetition penalty over the whole
context (``repeat_last_n`` = prompt + new tokens), as ours applies it; EOS is ignored.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from .procs import RssMonitor, free_port, log_tail, stop_tree
from .workload import stream_stats

SLOTS = 8


def completion_body(ids: Sequence[int], new_tokens: int, sampling: dict | None) -> dict:
    """The ``/completion`` request for a token-id prompt; ``sampling`` as for
    ``ours.server_single`` (``temperature``, ``top_p``, ``top_k``,
    ``repetition_penalty``, ``seed``), None: greedy."""
    body: dict[str, Any] = {
        "prompt": list(ids),
        "n_predict": new_tokens,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": False,
        "return_tokens": True,
        "min_p": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "repeat_penalty": 1.0,
        # The whole context, as ours applies the penalty (a current llama.cpp
        # refuses -1, which once meant that: it wants 0 <= n).
        "repeat_last_n": len(ids) + new_tokens,
    }
    if not sampling:
        body["temperature"] = 0.0  # llama-server: greedy
        return body
    names = {"repetition_penalty": "repeat_penalty"}
    for name, value in sampling.items():
        body[names.get(name, name)] = value
    return body


def parse_events(lines: Iterator[bytes]) -> Iterator[dict]:
    """The JSON objects of a server-sent-event stream (``data: {...}`` lines)."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def event_tokens(event: dict) -> int:
    """How many generated tokens one streamed event carries (0 for the final
    summary event, which repeats no token)."""
    if event.get("stop") and not event.get("content") and not event.get("tokens"):
        return 0
    tokens = event.get("tokens")
    return len(tokens) if isinstance(tokens, list) else 1


class LlamaServer:
    """A ``llama-server`` process on 127.0.0.1, its RSS watched from start to stop."""

    def __init__(
        self, binary: str | Path, gguf: str | Path, threads: int, start_timeout_s: float = 300.0
    ) -> None:
        self.port = free_port()
        self._log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives with the server
            prefix="bench-llama-", suffix=".log", delete=False
        )
        cmd = [
            str(binary),
            "-m", str(gguf),
            "-t", str(threads),
            "-tb", str(threads),
            "-np", str(SLOTS),
            "-c", str(SLOTS * 1024),
            "--host", "127.0.0.1",
            "--port", str(self.port),
        ]  # fmt: skip
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.monitor = RssMonitor(self.proc.pid)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _conn(self, timeout_s: float = 600.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited early:\n{self.log_tail()}")
            conn = self._conn(2.0)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.3)
        raise TimeoutError(f"llama-server not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self._log.name, lines)

    def _stream(
        self, ids: Sequence[int], new_tokens: int, sampling: dict | None
    ) -> tuple[list[float], list[int], dict]:
        """One streamed completion: arrival time and token count of each event,
        and the final event (llama-server's own ``timings``)."""
        conn = self._conn()
        times: list[float] = []
        counts: list[int] = []
        final: dict = {}
        try:
            body = json.dumps(completion_body(ids, new_tokens, sampling))
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(
                    f"llama-server /completion: {response.status} {response.read()!r}"
                )
            for event in parse_events(iter(response.readline, b"")):
                n = event_tokens(event)
                if n:
                    times.append(time.perf_counter())
                    counts.append(n)
                if event.get("stop"):
                    final = event
                    break
        finally:
            conn.close()
        return times, counts, final

    def single(self, ids: Sequence[int], new_tokens: int, sampling: dict | None = None) -> dict:
        submit = time.perf_counter()
        times, counts, final = self._stream(ids, new_tokens, sampling)
        stats = stream_stats(submit, times, counts)
        stats["server_timings"] = final.get("timings", {})
        return stats

    def concurrent(
        self,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        sampling: Sequence[dict | None] | None = None,
    ) -> dict:
        """All prompts at once, a thread (and connection) each."""
        per_prompt = list(sampling) if sampling is not None else [None] * len(prompts)
        streams: list[dict] = [{} for _ in prompts]
        errors: list[BaseException] = []
        start = threading.Barrier(len(prompts) + 1)

        def one(i: int) -> None:
            try:
                start.wait()
                times, counts, _ = self._stream(prompts[i], new_tokens, per_prompt[i])
                streams[i] = {"first": times[0], "last": times[-1], "tokens": sum(counts)}
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        submit = time.perf_counter()
        start.wait()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return {"submit": submit, "streams": streams}

    def stop(self) -> dict:
        hwm = self.monitor.hwm()
        self.monitor.stop()
        stop_tree(self.proc, timeout_s=10)  # type: ignore[arg-type]
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        return self.monitor.summary(hwm)
