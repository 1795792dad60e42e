"""The measurements of one run: every engine started once, then rep by rep.

Within a rep, the engines run one after another on the same token ids (ours
in-process, ours through the server, then onnxruntime-genai), so drift in the
machine's load spreads over all of them. On a shared 2-core machine, other
work taking even half a core slows a 2-thread ONNX Runtime step several-fold
(its threads meet at a barrier each op), so a rep during which other work took
more than ``NOISY_CORES`` is run again with fresh prompts (fresh, so that no
prefix cache helps the retry), up to ``retries`` times and within a time
budget; the least disturbed attempt is kept and flagged if still noisy.

Samplings (``workload.SAMPLINGS``, issue 14): every concurrency row runs in
each of ``plan.concurrency_samplings`` and the single streams in each of
``plan.single_samplings``, a rep of each sampling right after the greedy one,
each on prompts of its own. Each measured call also records the CPU seconds of
the processes it used (``procs.ProcCpu``: our frontend, engine process and
client; og's worker), reported per generated token.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from genai_client import Client

from .ortgenai import OgWorker
from .ours import (
    InProcessEngine,
    ServerProcess,
    server_concurrent,
    server_concurrent_go,
    server_sessions,
    server_single,
)
from .procs import CpuLedger, ProcCpu, wait_quiet
from .workload import (
    SAMPLINGS,
    SURFACE,
    Plan,
    TokenSource,
    Workload,
    concurrency_stats,
    median,
    summarize,
)

log = structlog.get_logger("bench")
SERVER = "genai-server (frontend + engine process)"
NOISY_CORES = 0.1  # other work above this during a measurement makes it noisy
SETTLE_S = 0.15  # pause between measurements (see Bench._timed)
P = TypeVar("P")
Calls = dict[str, tuple[Callable[..., Any], tuple, dict]]


class Bench:
    def __init__(
        self,
        plan: Plan,
        model_dir: Path,
        og_engine_dir: Path,
        *,
        quiet_wait_s: float = 30.0,
        retries: int = 2,
        retry_budget_s: float = 600.0,
        go_client: str | None = None,
    ) -> None:
        self.plan = plan
        # clients/go/cmd/genai-bench, built: the first concurrency shape's rows are
        # also driven by the Go client ("ours_go"), beside this process's asyncio one.
        self.go_client = go_client
        self.model_dir = str(model_dir)
        self.quiet_wait_s = quiet_wait_s
        self.retries = retries
        self.retry_budget_s = retry_budget_s
        self.notes: list[str] = []
        self.noisy: list[str] = []  # reps still disturbed by other work after retries
        self.retried: list[str] = []
        self.retry_s = 0.0
        self.waited_s = 0.0
        self._turn = 0  # which engine goes first in the next rep (see _in_turn)
        self._seeds = itertools.count(1)  # a seed per sampled request
        self.og: dict[str, OgWorker] = {}
        self.server: ServerProcess | None = None
        self.client: Client | None = None
        try:
            self._start(og_engine_dir)
            # After the in-process engine has loaded: built first, the memory
            # TokenSource freed after tokenizing its corpus was reused by the
            # session's load, and ~50 of its ~150 MB of weights missed the huge
            # pages the engine process gets (load_session collapses only the
            # address ranges a load added): decode steps 0-3 % slower in 3 paired
            # runs (2026-12-07).
            self.source = TokenSource(model_dir)
            self.workload = Workload.build(plan, self.source)
        except BaseException:
            self.close()
            raise

    def _start(self, og_engine_dir: Path) -> None:
        plan = self.plan
        threads, max_len = plan.threads, -(-plan.max_total_tokens // 256) * 256
        self.inproc = InProcessEngine(self.model_dir, threads)
        self.server = ServerProcess(self.model_dir, threads)
        self.client = Client(self.server.target)
        for share in (True, False):
            self.og[f"og_share_{str(share).lower()}"] = OgWorker(
                f"generator share={share}",
                self.model_dir,
                threads=threads,
                share_buffer=share,
                max_length=max_len,
                engine=False,
            )
        if "sessions" in plan.sections or "concurrency" in plan.sections:
            self.og["og_engine"] = OgWorker(
                "engine",
                str(og_engine_dir),
                threads=threads,
                share_buffer=True,
                max_length=max_len,
                engine=True,
            )

    @property
    def _client(self) -> Client:
        if self.client is None:
            raise RuntimeError("the server is not running")
        return self.client

    @property
    def _target(self) -> str:
        if self.server is None:
            raise RuntimeError("the server is not running")
        return self.server.target

    # -- measuring --------------------------------------------------------------------

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """``fn(*args, **kwargs)`` and the cores other work took meanwhile."""
        result, foreign, _ = self._timed_cpu(fn, args, kwargs, {})
        return result, foreign

    def _timed_cpu(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, groups: dict[str, list[int]]
    ) -> tuple[Any, float, dict[str, float]]:
        """``_timed``, plus the CPU seconds of each group of processes meanwhile."""
        # ONNX Runtime's threads spin for ~20-40 ms after a run; let the previous
        # engine's go quiet so they do not slow this one's first step.
        time.sleep(SETTLE_S)
        ledger = CpuLedger()
        cpu = ProcCpu(groups)
        result = fn(*args, **kwargs)
        return result, ledger.lap()["foreign_cores"], cpu.lap()

    def _server_cpu(self) -> dict[str, list[int]]:
        """The processes whose CPU a server call costs: frontend, engine, this
        process (the client)."""
        assert self.server is not None
        return {**self.server.cpu_groups(), "client": [os.getpid()]}

    def _og_cpu(self, worker: str) -> dict[str, list[int]]:
        """An onnxruntime-genai worker's process (engine and client in one)."""
        return {"og": [self.og[worker].proc.pid]}

    def _in_turn(self, calls: dict[str, Any]) -> list[tuple[str, Any]]:
        """The engines of one rep, in an order rotated from rep to rep.

        The first measurement after the quiet wait runs on a CPU just back
        from idle (here ~4 % slower over 128 tokens); with a fixed order that
        would always be the same engine's (ours).
        """
        items = list(calls.items())
        k = self._turn % len(items)
        self._turn += 1
        return items[k:] + items[:k]

    def _run_in_turn(
        self, calls: Calls, cpu: dict[str, dict[str, list[int]]] | None = None
    ) -> tuple[dict[str, Any], float]:
        """The calls of one rep, timed, in turn (``_in_turn``): each result with
        the cores other work took meanwhile (and, for the calls named in ``cpu``,
        the CPU seconds of those process groups: ``cpu_s``), and the worst of those."""
        out, worst = {}, 0.0
        for name, (fn, args, kwargs) in self._in_turn(calls):
            groups = (cpu or {}).get(name, {})
            result, foreign, cpu_s = self._timed_cpu(fn, args, kwargs, groups)
            out[name] = {**result, "foreign_cores": foreign}
            if groups:
                out[name]["cpu_s"] = cpu_s
            worst = max(worst, foreign)
        return out, worst

    def _rep(
        self,
        what: str,
        prompts: P,
        fresh: Callable[[], P],
        run: Callable[[P], tuple[dict[str, Any], float]],
    ) -> dict[str, Any]:
        """One rep of every engine (``run`` returns results by engine and the worst
        foreign load among them), retried with fresh prompts while noisy."""
        best: tuple[float, dict[str, Any]] | None = None
        for attempt in range(1 + self.retries):
            if attempt:
                if self.retry_s >= self.retry_budget_s:
                    break
                prompts = fresh()
                self.retried.append(f"{what} (attempt {attempt + 1})")
            if self.quiet_wait_s > 0:
                self.waited_s += wait_quiet(max_wait_s=self.quiet_wait_s)["waited_s"]
            started = time.monotonic()
            results, worst = run(prompts)
            if attempt:
                self.retry_s += time.monotonic() - started
            if best is None or worst < best[0]:
                best = (worst, results)
            if worst <= NOISY_CORES:
                break
        assert best is not None
        if best[0] > NOISY_CORES:
            self.noisy.append(f"{what}: {best[0]} cores")
        return best[1]

    def warmup(self) -> dict:
        """One short request per engine, then one burst of the most concurrent
        streams measured (the first use of a batch size or KV slot can cost far
        more than later ones); returns that cold burst's figures."""
        ids = self.workload.warmup
        self.inproc.single(ids, 8)
        server_single(self._client, ids, 8)
        for worker in self.og.values():
            worker.call("single", ids=ids, new_tokens=8)
        cold: dict = {}
        if "og_engine" in self.og:
            n = max(self.plan.concurrency) if "concurrency" in self.plan.sections else 4
            prompts = [self.source.take(len(ids)) for _ in range(n)]
            self.inproc.concurrent([self.source.take(len(ids)) for _ in range(n)], 4)
            o, f_ours = self._timed(server_concurrent, self._target, prompts, 16)
            g, f_og = self._timed(
                self.og["og_engine"].call, "concurrent", prompts=prompts, new_tokens=16
            )
            cold = {
                "streams": n,
                "prompt_tokens": len(ids),
                "new_tokens": 16,
                "ours": {**concurrency_stats(o["submit"], o["streams"]), "foreign_cores": f_ours},
                "og": {**concurrency_stats(g["submit"], g["streams"]), "foreign_cores": f_og},
            }
        return cold

    # -- 1. single streams ---------------------------------------------------------------

    def _sampling(self, name: str) -> dict | None:
        """A sampling's request fields with a fresh per-request seed; None: greedy."""
        sampling = SAMPLINGS[name]
        return None if sampling.greedy else {**sampling.params(), "seed": next(self._seeds)}

    def single(self) -> dict:
        """Greedy: in-process, server, og.Generator (share_buffer true and false);
        each other sampling of ``plan.single_samplings``: server and og.Generator,
        on prompts of its own (fresh, so the server's prefix cache never helps),
        rep by rep after the greedy one."""
        new = self.plan.single_new_tokens
        engines = ["ours_inproc", "ours_server", "og_share_true", "og_share_false"]
        sampled_engines = ["ours_server", "og_share_true", "og_share_false"]
        sampled = [n for n in self.plan.single_samplings if n != "greedy"]
        probe_len = 512 if 512 in self.plan.single_lengths else self.plan.single_lengths[0]
        raw: dict[str, dict[str, list[dict]]] = {e: {} for e in [*engines, "og_all_logits"]}
        raw_s: dict[str, dict[str, dict[str, list[dict]]]] = {
            n: {e: {} for e in sampled_engines} for n in sampled
        }
        cpu = {
            "ours_server": self._server_cpu(),
            "og_share_true": self._og_cpu("og_share_true"),
            "og_share_false": self._og_cpu("og_share_false"),
        }
        for length, prompts in self.workload.single.items():
            key = str(length)
            probe = length == probe_len and "og_engine" in self.og

            def run(ids: list[int], probe: bool = probe) -> tuple[dict[str, Any], float]:
                calls: Calls = {
                    "ours_inproc": (self.inproc.single, (ids, new), {}),
                    "ours_server": (server_single, (self._client, ids, new), {}),
                }
                for e in ("og_share_true", "og_share_false"):
                    calls[e] = (self.og[e].call, ("single",), {"ids": ids, "new_tokens": new})
                if probe:
                    calls["og_all_logits"] = (
                        self.og["og_engine"].call,
                        ("single",),
                        {"ids": ids, "new_tokens": new},
                    )
                return self._run_in_turn(calls, cpu)

            def run_sampled(ids: list[int], name: str) -> tuple[dict[str, Any], float]:
                params = self._sampling(name)
                calls: Calls = {
                    "ours_server": (server_single, (self._client, ids, new, params), {}),
                }
                for e in ("og_share_true", "og_share_false"):
                    calls[e] = (
                        self.og[e].call,
                        ("single",),
                        {"ids": ids, "new_tokens": new, "sampling": params},
                    )
                return self._run_in_turn(calls, cpu)

            for rep, ids in enumerate(prompts):
                results = self._rep(
                    f"single {length} rep {rep}", ids, lambda n=length: self.source.take(n), run
                )
                for name, result in results.items():
                    raw[name].setdefault(key, []).append(result)
                for sname in sampled:
                    results = self._rep(
                        f"single {sname} {length} rep {rep}",
                        self.source.take(length),
                        lambda n=length: self.source.take(n),
                        functools.partial(run_sampled, name=sname),
                    )
                    for name, result in results.items():
                        raw_s[sname][name].setdefault(key, []).append(result)
                log.info("single", length=length, rep=rep)
        keys = ("ttft_s", "decode_tok_s")
        out: dict = {e: {k: _summary(v, keys) for k, v in raw[e].items()} for e in engines}
        out["og_best"] = _og_best(out["og_share_true"], out["og_share_false"])
        if raw["og_all_logits"]:
            out["og_all_logits_probe"] = {
                "length": probe_len,
                **summarize(raw["og_all_logits"][str(probe_len)], keys),
            }
        out["agreement"] = _agreement(raw)
        out["samplings"] = {}
        for sname, by_engine in raw_s.items():
            o: dict[str, Any] = {
                e: {k: _summary(v, keys) for k, v in r.items()} for e, r in by_engine.items()
            }
            o["og_best"] = _og_best(o["og_share_true"], o["og_share_false"])
            o["label"] = SAMPLINGS[sname].label
            out["samplings"][sname] = o
        cached = [r.get("cached_tokens", 0) for v in raw["ours_server"].values() for r in v]
        cached += [
            r.get("cached_tokens", 0)
            for by_engine in raw_s.values()
            for v in by_engine["ours_server"].values()
            for r in v
        ]
        if any(cached):
            self.notes.append(f"the server reused prefix KV in single-stream runs: {cached}")
        return out

    # -- 2. sessions -----------------------------------------------------------------------

    def sessions(self) -> dict:
        new = self.plan.session_new_tokens
        og = self.og["og_engine"]
        sinks: dict[str, list[list[dict]]] = {
            "ours_alone": [],
            "og_alone": [],
            "ours_inter": [],
            "og_inter": [],
        }

        def run(convs: list[list[list[int]]]) -> tuple[dict[str, Any], float]:
            alone, inter = convs[:1], convs[1:]
            calls: dict[str, tuple[Callable[..., Any], tuple, dict]] = {
                "ours_alone": (server_sessions, (self._client, alone, new), {}),
                "og_alone": (og.call, ("sessions",), {"conversations": alone, "new_tokens": new}),
                "ours_inter": (server_sessions, (self._client, inter, new), {}),
                "og_inter": (og.call, ("sessions",), {"conversations": inter, "new_tokens": new}),
            }
            out, worst = {}, 0.0
            for name, (fn, args, kwargs) in self._in_turn(calls):
                result, foreign = self._timed(fn, *args, **kwargs)
                for conv in result:
                    for turn in conv:
                        turn["foreign_cores"] = foreign
                out[name] = result
                worst = max(worst, foreign)
            return out, worst

        plan = self.plan

        def fresh() -> list[list[list[int]]]:
            return [
                [
                    self.source.take(plan.session_new_prompt_tokens)
                    for _ in range(plan.session_turns)
                ]
                for _ in range(1 + plan.session_conversations)
            ]

        for rep, convs in enumerate(self.workload.sessions):
            results = self._rep(f"sessions rep {rep}", convs, fresh, run)
            for name, result in results.items():
                sinks[name] += result
            log.info("sessions", rep=rep)
        return {
            "conversations": plan.session_conversations,
            "alone": _per_turn(sinks["ours_alone"], sinks["og_alone"]),
            "interleaved": _per_turn(sinks["ours_inter"], sinks["og_inter"]),
        }

    # -- 3. concurrency -----------------------------------------------------------------

    def concurrency(self) -> dict:
        """Every (shape, streams) row in each sampling of ``plan.concurrency_samplings``:
        greedy through the server, in-process and og.Engine; the others through the
        server and og.Engine with the same settings (a seed per request), on prompts
        of their own, rep by rep after the greedy one."""
        og = self.og["og_engine"]
        assert self.server is not None
        cpu = {
            "ours": self._server_cpu(),
            "ours_go": self.server.cpu_groups(),  # + the Go process's own figure
            "og": self._og_cpu("og_engine"),
        }
        samplings = self.plan.concurrency_samplings
        out: dict = {}
        for i, ((prompt_len, new), levels) in enumerate(self.workload.concurrency.items()):
            shape = f"{prompt_len}-token prompts + {new} new tokens"
            out[shape] = {}
            go = self.go_client if i == 0 else None

            def run(
                prompts: list[list[int]],
                new: int = new,
                sampling: str = "greedy",
                go: str | None = go,
            ) -> tuple[dict[str, Any], float]:
                params = (
                    None if sampling == "greedy" else [self._sampling(sampling) for _ in prompts]
                )
                calls: Calls = {
                    "ours": (server_concurrent, (self._target, prompts, new, params), {}),
                    "og": (
                        og.call,
                        ("concurrent",),
                        {"prompts": prompts, "new_tokens": new, "sampling": params},
                    ),
                }
                if sampling == "greedy":
                    calls["ours_inproc"] = (self.inproc.concurrent, (prompts, new), {})
                if go:
                    # The same requests (and seeds) as "ours", from the Go client.
                    calls["ours_go"] = (
                        server_concurrent_go,
                        (go, self._target, prompts, new, params),
                        {},
                    )
                out, worst = self._run_in_turn(calls, cpu)
                stats = {}
                for name, r in out.items():
                    cpu_s = dict(r.get("cpu_s") or {})
                    if "client_cpu_s" in r:
                        cpu_s["client"] = r["client_cpu_s"]
                    stats[name] = {
                        **concurrency_stats(r["submit"], r["streams"]),
                        "foreign_cores": r["foreign_cores"],
                        **({"cpu_s": cpu_s} if cpu_s else {}),
                    }
                return stats, worst

            for n, reps in levels.items():
                sinks: dict[str, dict[str, list[dict]]] = {m: {} for m in samplings}
                for rep, prompts in enumerate(reps):
                    for sampling in samplings:
                        first = prompts if sampling == "greedy" else None
                        results = self._rep(
                            f"concurrency {prompt_len}+{new} x{n} {sampling} rep {rep}",
                            first or [self.source.take(prompt_len) for _ in range(n)],
                            lambda n=n, p=prompt_len: [self.source.take(p) for _ in range(n)],
                            functools.partial(run, new=new, sampling=sampling),
                        )
                        for name, result in results.items():
                            sinks[sampling].setdefault(name, []).append(result)
                    log.info("concurrency", shape=shape, streams=n, rep=rep)
                keys = ("agg_tok_s", "ttft_p50_s", "ttft_p99_s")
                row: dict = {}
                for sampling, sink in sinks.items():
                    summary = {name: _summary(v, keys) for name, v in sink.items()}
                    if sampling == "greedy":
                        row.update(summary)  # the greedy figures stay where they always were
                    else:
                        row.setdefault("samplings", {})[sampling] = summary
                out[shape][str(n)] = row
        return out

    # -- 3b. the model's full window --------------------------------------------------------

    def long(self) -> dict:
        """One stream whose prompt + new tokens fill the model's context window,
        through a server and an og.Generator of their own (the og worker's KV
        sized to the window), so that the other rows' processes keep their peak
        RSS and KV sizing; both peaks are reported here."""
        plan = self.plan
        new = plan.long_new_tokens
        server = ServerProcess(self.model_dir, plan.threads)
        client = Client(server.target)
        worker: OgWorker | None = None
        raw: dict[str, dict[str, list[dict]]] = {m: {} for m in plan.single_samplings}
        rss: dict[str, dict] = {}
        try:
            worker = OgWorker(
                "generator long context",
                self.model_dir,
                threads=plan.threads,
                share_buffer=True,
                max_length=plan.long_context,
                engine=False,
            )
            cpu = {
                "ours_server": {**server.cpu_groups(), "client": [os.getpid()]},
                "og": {"og": [worker.proc.pid]},
            }
            server_single(client, self.workload.warmup, 8)
            worker.call("single", ids=self.workload.warmup, new_tokens=8)

            def run(ids: list[int], sampling: str) -> tuple[dict[str, Any], float]:
                assert worker is not None
                params = self._sampling(sampling)
                calls: Calls = {
                    "ours_server": (server_single, (client, ids, new, params), {}),
                    "og": (
                        worker.call,
                        ("single",),
                        {"ids": ids, "new_tokens": new, "sampling": params},
                    ),
                }
                return self._run_in_turn(calls, cpu)

            for rep, prompts in enumerate(self.workload.long):
                for sampling, ids in prompts.items():
                    results = self._rep(
                        f"long {sampling} rep {rep}",
                        ids,
                        lambda: self.source.take(plan.long_prompt_tokens),
                        functools.partial(run, sampling=sampling),
                    )
                    for name, result in results.items():
                        raw[sampling].setdefault(name, []).append(result)
                log.info("long", rep=rep)
        finally:
            client.close()
            rss[SERVER] = server.stop()
            if worker is not None:
                rss[f"onnxruntime-genai {worker.name}"] = worker.stop()
        keys = ("ttft_s", "decode_tok_s")
        return {
            "prompt_tokens": plan.long_prompt_tokens,
            "new_tokens": new,
            "samplings": {
                m: {e: _summary(v, keys) for e, v in by_engine.items()}
                for m, by_engine in raw.items()
            },
            "rss": rss,
        }

    # -- 3c. llama.cpp's llama-server (optional) -------------------------------------------

    def llama_server(self, binary: str, gguf: str) -> dict:
        """Single streams (``plan.llama_lengths``, each sampling of the single
        streams) and the first concurrency shape at its most streams (each
        sampling of the concurrency rows), through our server and a
        ``llama-server`` on the same GGUF, in turn, rep by rep."""
        from .llama import SLOTS, LlamaServer

        plan = self.plan
        new = plan.single_new_tokens
        llama = LlamaServer(binary, gguf, plan.threads)
        cpu = {"ours": self._server_cpu(), "llama": {"llama": [llama.proc.pid]}}
        prompt_len, conc_new = plan.shapes[0]
        streams = min(max(plan.concurrency), SLOTS)
        # The fewer-stream rows (1-4 users: most CPU deployments) below the top one.
        fewer = sorted({min(n, SLOTS) for n in plan.concurrency} - {streams})
        single: dict[str, dict[str, dict[str, list[dict]]]] = {}
        conc: dict[str, dict[str, list[dict]]] = {}
        levels: dict[str, dict[str, dict[str, list[dict]]]] = {}
        try:
            llama.single(self.workload.warmup, 8)

            def run_single(ids: list[int], sampling: str) -> tuple[dict[str, Any], float]:
                params = self._sampling(sampling)
                calls: Calls = {
                    "ours": (server_single, (self._client, ids, new, params), {}),
                    "llama": (llama.single, (ids, new, params), {}),
                }
                return self._run_in_turn(calls, cpu)

            def run_conc(prompts: list[list[int]], sampling: str) -> tuple[dict[str, Any], float]:
                params = [self._sampling(sampling) for _ in prompts]
                calls: Calls = {
                    "ours": (server_concurrent, (self._target, prompts, conc_new, params), {}),
                    "llama": (llama.concurrent, (prompts, conc_new, params), {}),
                }
                out, worst = self._run_in_turn(calls, cpu)
                return _stats_by_name(out), worst

            for rep in range(plan.reps):
                for length in plan.llama_lengths:
                    for sampling in plan.single_samplings:
                        results = self._rep(
                            f"llama-server single {length} {sampling} rep {rep}",
                            self.source.take(length),
                            lambda n=length: self.source.take(n),
                            functools.partial(run_single, sampling=sampling),
                        )
                        for name, result in results.items():
                            by = single.setdefault(sampling, {}).setdefault(name, {})
                            by.setdefault(str(length), []).append(result)
                for n in [*fewer, streams]:
                    for sampling in plan.concurrency_samplings:
                        results = self._rep(
                            f"llama-server {n} streams {sampling} rep {rep}",
                            [self.source.take(prompt_len) for _ in range(n)],
                            lambda n=n: [self.source.take(prompt_len) for _ in range(n)],
                            functools.partial(run_conc, sampling=sampling),
                        )
                        by = conc if n == streams else levels.setdefault(str(n), {})
                        for name, result in results.items():
                            by.setdefault(sampling, {}).setdefault(name, []).append(result)
                log.info("llama-server", rep=rep)
        finally:
            rss = llama.stop()
        keys = ("ttft_s", "decode_tok_s")
        ckeys = ("agg_tok_s", "ttft_p50_s", "ttft_p99_s")
        return {
            "binary": binary,
            "gguf": gguf,
            "command": llama.cmd,
            "single_new_tokens": new,
            "single": {
                m: {e: {k: _summary(v, keys) for k, v in r.items()} for e, r in by.items()}
                for m, by in single.items()
            },
            "concurrency": {
                "streams": streams,
                "shape": f"{prompt_len}-token prompts + {conc_new} new tokens",
                "samplings": {
                    m: {e: _summary(v, ckeys) for e, v in by.items()} for m, by in conc.items()
                },
            },
            # The same shape at fewer streams: {streams: {"samplings": ...}}.
            "fewer_streams": {
                n: {
                    "samplings": {
                        m: {e: _summary(v, ckeys) for e, v in by.items()} for m, by in lv.items()
                    }
                }
                for n, lv in levels.items()
            },
            "rss": rss,
        }

    # -- 3c. the decoding surface -----------------------------------------------------------

    def surface(self) -> dict:
        """The sampled row at the first shape's most streams with DRY, XTC and
        logit_bias set (``workload.SURFACE``), against the same row without them,
        through the server, on fresh prompts (nothing cached from the other rows)."""
        (prompt_len, new), levels = next(iter(self.workload.concurrency.items()))
        n = max(levels)
        cpu = {"plain": self._server_cpu(), "surface": self._server_cpu()}

        def fresh() -> list[list[int]]:
            return [self.source.take(prompt_len) for _ in range(n)]

        def run(prompts: list[list[int]]) -> tuple[dict[str, Any], float]:
            plain = [self._sampling("sampled") for _ in prompts]
            extended = [{**p, **SURFACE} for p in plain if p is not None]  # the same seeds
            calls: Calls = {
                "plain": (server_concurrent, (self._target, prompts, new, plain), {}),
                "surface": (server_concurrent, (self._target, fresh(), new, extended), {}),
            }
            out, worst = self._run_in_turn(calls, cpu)
            return _stats_by_name(out), worst

        sinks: dict[str, list[dict]] = {}
        for rep in range(self.plan.reps):
            results = self._rep(f"surface x{n} rep {rep}", fresh(), fresh, run)
            for name, result in results.items():
                sinks.setdefault(name, []).append(result)
            log.info("surface", streams=n, rep=rep)
        keys = ("agg_tok_s", "ttft_p50_s", "ttft_p99_s")
        return {
            "shape": f"{prompt_len}-token prompts + {new} new tokens",
            "streams": n,
            "fields": SURFACE,
            **{name: _summary(v, keys) for name, v in sinks.items()},
        }

    # -- 4. speculative decoding ---------------------------------------------------------------

    def speculation(self) -> dict:
        """Single streams through a second server started with ``--speculate``,
        next to the plain server and og.Generator, on three kinds of task."""
        new = self.plan.single_new_tokens
        k = self.plan.speculate
        spec_server = ServerProcess(
            self.model_dir, self.plan.threads, extra_args=["--speculate", str(k)]
        )
        spec_client = Client(spec_server.target)
        engines = ["ours_server", "ours_speculating", "og_share_true"]
        raw: dict[str, dict[str, list[dict]]] = {e: {} for e in engines}
        try:
            server_single(spec_client, self.workload.warmup, 8)
            for task, prompts in self.workload.speculation.items():

                def run(ids: list[int]) -> tuple[dict[str, Any], float]:
                    calls: dict[str, tuple[Callable[..., Any], tuple, dict]] = {
                        "ours_server": (server_single, (self._client, ids, new), {}),
                        "ours_speculating": (server_single, (spec_client, ids, new), {}),
                        "og_share_true": (
                            self.og["og_share_true"].call,
                            ("single",),
                            {"ids": ids, "new_tokens": new},
                        ),
                    }
                    return self._run_in_turn(calls)

                for rep, ids in enumerate(prompts):
                    # no fresh prompts for a noisy rep: a task's prompts are few
                    results = self._rep(
                        f"speculation {task} rep {rep}", ids, functools.partial(list, ids), run
                    )
                    for name, result in results.items():
                        raw[name].setdefault(task, []).append(result)
                    log.info("speculation", task=task, rep=rep)
        finally:
            spec_client.close()
            spec_server.stop()
        keys = ("ttft_s", "decode_tok_s")
        out: dict = {e: {t: summarize(v, keys) for t, v in raw[e].items()} for e in engines}
        out["draft_tokens"] = k
        out["prompt_tokens"] = {
            t: [len(i) for i in p] for t, p in self.workload.speculation.items()
        }
        out["same_first_32"] = {
            t: [
                a["token_ids"] == b["token_ids"]
                for a, b in zip(raw["ours_server"][t], raw["ours_speculating"][t], strict=True)
            ]
            for t in raw["ours_server"]
        }
        return out

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> dict:
        """Stop every process; returns their peak RSS figures."""
        procs: dict[str, dict] = {}
        if self.server is not None:
            procs[SERVER] = self.server.stop()
            self.server = None
        if self.client is not None:
            self.client.close()
            self.client = None
        for worker in self.og.values():
            procs[f"onnxruntime-genai {worker.name}"] = worker.stop()
        self.og = {}
        og_peaks = [d["hwm_sum_mb"] for k, d in procs.items() if k.startswith("onnx")]
        return {
            "processes": procs,
            "ours_server_tree_mb": procs[SERVER]["hwm_sum_mb"] if SERVER in procs else None,
            "og_max_mb": max(og_peaks) if og_peaks else None,
        }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _agreement(raw: dict[str, dict[str, list[dict]]]) -> str:
    """How many leading greedy tokens (rep 0) each engine shares with og (share=true)."""
    parts = []
    for k, reps in raw["og_share_true"].items():
        ref = reps[0]["token_ids"]
        same = {
            e: _common_prefix(raw[e][k][0]["token_ids"], ref)
            for e in ("ours_inproc", "ours_server", "og_share_false")
        }
        parts.append(
            f"{k}: in-process {same['ours_inproc']}/{len(ref)}, server "
            f"{same['ours_server']}/{len(ref)}, og share=false {same['og_share_false']}"
            f"/{len(ref)}"
        )
    return "; ".join(parts)


def _per_turn(ours: list[list[dict]], og: list[list[dict]]) -> dict:
    """Median TTFT per turn over every conversation and rep; og's request modes."""
    turns = len(ours[0])
    return {
        "ours": [median([conv[t]["ttft_s"] for conv in ours]) for t in range(turns)],
        "og": [median([conv[t]["ttft_s"] for conv in og]) for t in range(turns)],
        "og_modes": ["/".join(sorted({conv[t]["mode"] for conv in og})) for t in range(turns)],
        "ours_cached_tokens": [[conv[t]["cached_tokens"] for t in range(turns)] for conv in ours],
        "og_prompt_tokens_fed": [
            [conv[t]["prompt_tokens_fed"] for t in range(turns)] for conv in og
        ],
        "ours_raw": ours,
        "og_raw": og,
    }


def _stats_by_name(out: dict[str, Any]) -> dict[str, dict]:
    """Each engine's concurrency statistics of one rep, with the foreign load
    and the CPU seconds measured meanwhile."""
    return {
        name: {
            **concurrency_stats(r["submit"], r["streams"]),
            "foreign_cores": r["foreign_cores"],
            "cpu_s": r.get("cpu_s", {}),
        }
        for name, r in out.items()
    }


def _cpu_ms_per_token(reps: Sequence[dict]) -> dict[str, float]:
    """Each process group's CPU milliseconds per generated token, pooled over the
    reps (their CPU seconds over their tokens): utime and stime tick at 10 ms, so
    a per-rep ratio of a 128-token stream would move in steps of ~0.08 ms."""
    seconds: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for r in reps:
        for group, s in (r.get("cpu_s") or {}).items():
            if r.get("tokens") and s == s:  # NaN: a process vanished meanwhile
                seconds[group] = seconds.get(group, 0.0) + s
                tokens[group] = tokens.get(group, 0) + int(r["tokens"])
    return {g: 1000.0 * seconds[g] / tokens[g] for g in seconds}


def _summary(reps: Sequence[dict], keys: Sequence[str]) -> dict:
    """``summarize`` plus the CPU per token (``cpu_ms_per_token``) where measured."""
    out = summarize(reps, keys)
    cpu = _cpu_ms_per_token(reps)
    if cpu:
        out["cpu_ms_per_token"] = cpu
    return out


def _og_best(share_true: dict[str, dict], share_false: dict[str, dict]) -> dict[str, dict]:
    """Per length, og.Generator's better TTFT and better decode of its two settings."""
    best: dict[str, dict] = {}
    for k in share_true:
        t, f = share_true[k], share_false[k]
        best[k] = {
            "ttft_s": min(t["ttft_s"], f["ttft_s"]),
            "ttft_setting": "true" if t["ttft_s"] <= f["ttft_s"] else "false",
            "decode_tok_s": max(t["decode_tok_s"], f["decode_tok_s"]),
            "decode_setting": "true" if t["decode_tok_s"] >= f["decode_tok_s"] else "false",
        }
    return best
