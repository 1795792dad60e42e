"""onnxruntime-genai, measured in worker processes of its own.

Each worker (``python -m bench.ortgenai``) loads one ``og.Model`` and
answers JSON-line commands on stdin/stdout, so its peak RSS is its own (the
worker imports only numpy and onnxruntime_genai). Timing happens inside the
worker with the same rules as ours (``workload.stream_stats``):

- ``single``: ``og.Generator``; the clock starts before ``GeneratorParams``;
  the first token is the one sampled right after ``append_tokens``.
- ``sessions``: ``og.Engine`` requests, one per conversation, continued with
  ``begin_turn``. In 0.18 on CPU a static-batch engine continues a request only
  while it is the only resident one; otherwise ``begin_turn`` fails, and the
  worker closes that request and opens a new one with the whole history (the
  re-prefill onnxruntime-genai users must do), recording which happened.
- ``concurrent``: ``og.Engine``, all requests submitted at once.

Settings come as a ``genai_config.json`` overlay (``og.Config.overlay``):
``intra_op_num_threads``, ``past_present_share_buffer`` and ``max_length``
(the KV length onnxruntime-genai sizes its buffers by).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

TOKEN = 1  # og.EngineEventFlags
TURN_FINISHED = 2
FAILED = 8


class _Og:
    def __init__(
        self,
        model_dir: str,
        threads: int,
        share_buffer: bool,
        max_length: int,
        engine: bool,
        kv_floor: int = 0,
    ) -> None:
        import onnxruntime_genai as og

        self.og = og
        # A generator's KV is at least this long (Gemma 3's local layers refuse
        # a cache shorter than their window), whatever the request's length.
        self.kv_floor = kv_floor
        config = og.Config(model_dir)
        config.overlay(
            json.dumps(
                {
                    "model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}},
                    "search": {
                        "past_present_share_buffer": share_buffer,
                        "max_length": max_length,
                    },
                }
            )
        )
        self.model = og.Model(config)
        self.engine = og.Engine(self.model) if engine else None
        self.buffer = self.engine.create_event_buffer(256) if self.engine else None

    def info(self) -> dict:
        out: dict[str, Any] = {"pid": os.getpid()}
        if self.engine is not None:
            caps = self.engine.get_capabilities()
            out["engine_max_batch_size"] = int(caps.configured_max_batch_size)
        return out

    # -- og.Generator ------------------------------------------------------------

    def single(self, ids: Sequence[int], new_tokens: int, sampling: dict | None = None) -> dict:
        """``sampling``: ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``,
        ``seed`` (``workload.Sampling.params`` plus a seed); None: greedy."""
        og = self.og
        total = len(ids) + new_tokens
        times: list[float] = []
        tokens: list[int] = []
        submit = time.perf_counter()
        params = og.GeneratorParams(self.model)
        # min_length = the request's length: EOS is masked, exactly new_tokens come out
        # (max_length may be longer: kv_floor).
        params.set_search_options(
            max_length=max(total, self.kv_floor), min_length=total, **_search_options(sampling)
        )
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray([ids], np.int32))
        while len(tokens) < new_tokens and not gen.is_done():
            gen.generate_next_token()
            times.append(time.perf_counter())
            tokens.append(int(gen.get_next_tokens()[0]))
        del gen
        return _stream_stats(submit, times, tokens)

    # -- og.Engine ---------------------------------------------------------------

    def _turn_options(self, request: Any, new_tokens: int, sampling: dict | None = None) -> Any:
        opts = self.og.TurnOptions(request)
        sampling = dict(sampling or {})
        opts.set_do_sample(bool(sampling))
        if sampling:
            # 0.18's static-batch Engine refuses a per-turn seed ("requires an Engine
            # configured for dynamic batching"): its requests draw from its own RNG.
            sampling.pop("seed", None)
            setters = {
                "temperature": opts.set_temperature,
                "top_p": opts.set_top_p,
                "top_k": opts.set_top_k,
                "repetition_penalty": opts.set_repetition_penalty,
            }
            for name, value in sampling.items():
                setters[name](value)
        opts.set_max_generated_tokens(new_tokens)
        opts.set_min_generated_tokens(new_tokens)  # ignore EOS
        return opts

    def _drive(self, requests: list[Any]) -> list[dict]:
        """Run the engine until every request's current turn finished; per request:
        token arrival times and tokens."""
        assert self.engine is not None and self.buffer is not None
        state = [{"times": [], "tokens": [], "done": False} for _ in requests]
        while not all(s["done"] for s in state):
            if not self.engine.has_pending_requests():
                raise RuntimeError("og.Engine has no pending work but turns are unfinished")
            self.engine.run(self.buffer)
            now = time.perf_counter()
            for k in range(len(self.buffer)):
                event = self.buffer[k]
                idx = next((i for i, r in enumerate(requests) if r is event.request), None)
                if idx is None:
                    continue
                flags = int(event.flags)
                if flags & FAILED:
                    raise RuntimeError(f"og.Engine request failed: {event.error_code}")
                if flags & TOKEN:
                    state[idx]["times"].append(now)
                    state[idx]["tokens"].append(int(event.token))
                if flags & TURN_FINISHED:
                    state[idx]["done"] = True
        return state

    def concurrent(
        self,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        sampling: Sequence[dict | None] | None = None,
    ) -> dict:
        """``sampling``: per prompt, as for ``single`` (None: all greedy)."""
        assert self.engine is not None
        per_prompt = list(sampling) if sampling is not None else [None] * len(prompts)
        submit = time.perf_counter()
        requests = []
        for ids, params in zip(prompts, per_prompt, strict=True):
            request = self.engine.create_request()
            request.begin_turn(
                np.asarray(ids, np.int32), self._turn_options(request, new_tokens, params)
            )
            requests.append(request)
        state = self._drive(requests)
        for request in requests:
            request.close()
        streams = [
            {"first": s["times"][0], "last": s["times"][-1], "tokens": len(s["tokens"])}
            for s in state
        ]
        return {"submit": submit, "streams": streams}

    def sessions(self, conversations: Sequence[Sequence[Sequence[int]]], new_tokens: int) -> list:
        """Conversations run turn by turn, interleaved; per conversation, per turn:
        TTFT, whether the request was continued or re-prefilled, prompt tokens fed."""
        assert self.engine is not None
        requests: list[Any] = [None] * len(conversations)
        history: list[list[int]] = [[] for _ in conversations]
        results: list[list[dict]] = [[] for _ in conversations]
        for turn in range(len(conversations[0])):
            for c, conv in enumerate(conversations):
                new = list(conv[turn])
                submit = time.perf_counter()
                mode, fed = "continue", len(new)
                request = requests[c]
                if request is not None:
                    try:
                        request.begin_turn(
                            np.asarray(new, np.int32), self._turn_options(request, new_tokens)
                        )
                    except RuntimeError:  # more than one resident request: start over
                        request.close()
                        request = None
                if request is None:
                    mode = "reprefill" if history[c] else "new"
                    fed = len(history[c]) + len(new)
                    request = self.engine.create_request()
                    request.begin_turn(
                        np.asarray(history[c] + new, np.int32),
                        self._turn_options(request, new_tokens),
                    )
                    requests[c] = request
                (state,) = self._drive([request])
                history[c] += new + state["tokens"]
                results[c].append(
                    {
                        "ttft_s": state["times"][0] - submit,
                        "mode": mode,
                        "prompt_tokens_fed": fed,
                        "tokens": len(state["tokens"]),
                    }
                )
        for request in requests:
            if request is not None:
                request.close()
        return results


def _search_options(sampling: dict | None) -> dict:
    """og.GeneratorParams search options for a sampling dict (see ``_Og.single``)."""
    if not sampling:
        return {"do_sample": False}
    out: dict[str, Any] = {"do_sample": True}
    for name, value in sampling.items():
        out["random_seed" if name == "seed" else name] = value
    return out


def _stream_stats(submit: float, times: list[float], tokens: list[int]) -> dict:
    n = len(tokens)
    if n == 0:
        return {"ttft_s": float("nan"), "decode_tok_s": float("nan"), "tokens": 0}
    first, last = times[0], times[-1]
    decode = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return {
        "ttft_s": first - submit,
        "decode_tok_s": decode,
        "tokens": n,
        "total_s": last - submit,
        "token_ids": tokens[:32],
    }


def _serve(proto_in: IO[str], proto_out: IO[str], args: dict) -> None:
    og = _Og(**args)
    proto_out.write(json.dumps({"ok": og.info()}) + "\n")
    proto_out.flush()
    for line in proto_in:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "stop":
            return
        try:
            result = getattr(og, op)(**cmd)
            reply = {"ok": result}
        except Exception:
            reply = {"error": traceback.format_exc()}
        proto_out.write(json.dumps(reply) + "\n")
        proto_out.flush()


def main() -> None:
    # The protocol owns the original stdout; anything the library prints goes to stderr.
    proto_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _serve(sys.stdin, proto_out, json.loads(sys.argv[1]))


class OgWorker:
    """Parent side: one worker process, its RSS watched from start to stop."""

    def __init__(
        self,
        name: str,
        model_dir: str,
        *,
        threads: int,
        share_buffer: bool,
        max_length: int,
        engine: bool,
        kv_floor: int = 0,
    ) -> None:
        from .procs import REPO, RssMonitor

        self.name = name
        args = {
            "model_dir": model_dir,
            "threads": threads,
            "share_buffer": share_buffer,
            "max_length": max_length,
            "engine": engine,
        }
        if kv_floor:
            args["kv_floor"] = kv_floor
        self.settings = {k: v for k, v in args.items() if k != "model_dir"}
        self.model_dir = model_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.ortgenai", json.dumps(args)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.monitor = RssMonitor(self.proc.pid)
        try:
            self.info = self._reply()
        except BaseException:
            self.stop()
            raise

    def _reply(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"onnxruntime-genai worker {self.name} exited ({self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"onnxruntime-genai worker {self.name}:\n{reply['error']}")
        return reply["ok"]

    def call(self, op: str, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def stop(self) -> dict:
        """Stop the worker; returns its peak RSS figures (read just before stopping)."""
        from .procs import stop_tree

        hwm = self.monitor.hwm()
        self.monitor.stop()
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_tree(self.proc, timeout_s=5)  # type: ignore[arg-type]
        return self.monitor.summary(hwm)


if __name__ == "__main__":
    main()
