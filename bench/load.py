"""``python -m bench.load`` (``make load``): a bounded soak of a kvstore + server pair.

    python -m bench.load                          # 600 s, 8 workers, the default model
    python -m bench.load --duration-s 60 --workers 4 --model DIR
    python -m bench.load --prefix-cache-bytes 0   # flags it does not know go to genai-server

Starts ``genai-kvstore`` and ``genai-server`` on free 127.0.0.1 ports (a random
data-plane token in both children's environment), computes the expected tokens
of a fixed set of greedy and seeded requests in a quiet run (one request at a
time), then runs ``--workers`` threads for ``--duration-s`` seconds, each
picking at random among: unary ``Generate``, ``GenerateStream``, ``GenerateBidi``
(several requests on one call, one of them cancelled), session turns (create,
a few turns, close), client cancellations, short deadlines, invalid requests
and random prompts (fuzz). Every completed greedy or seeded response is
compared with the quiet run's tokens; a response cut short by its own cancel
or deadline must be a prefix of them.

Prints requests by kind and RPC, outcomes by status code, INTERNAL/UNKNOWN,
token mismatches, p50/p99 latency per RPC and the RSS of frontend, engine and
kvstore at start and end (sampled through the run too), and writes it all as
JSON under ``bench/results/``. Exits 1 on any INTERNAL/UNKNOWN, token mismatch
or status code a request of its kind must not get; 2 if the quiet run fails.
What the figures mean: ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import secrets
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from genai_client import Client
from genai_client.errors import GenAIClientError, from_rpc_error
from genai_proto.genai.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from kvstore.protocol import AUTH_TOKEN_ENV

from .ours import ServerProcess
from .procs import MB, REPO, free_port, machine_info, proc_status_bytes, versions

RESULTS = REPO / "bench" / "results"
KINDS = ("unary", "stream", "bidi", "session", "cancel", "deadline", "invalid", "random")
DEFAULT_MIX = "unary=3,stream=3,bidi=2,session=2,cancel=2,deadline=2,invalid=1,random=1"
CALL_TIMEOUT_S = 120.0  # bounds every call, so a hang ends the run instead of stalling it
CUT_SHORT = frozenset({"CANCELLED", "TIME_LIMIT"})
FAILING = frozenset({"INTERNAL", "UNKNOWN"})
RANDOM_MAX_PROMPT = 600  # tokens: a few KV chunks at the default --kv-chunk-size
MAX_DETAILS = 20  # mismatches / unexpected codes kept in full in the JSON


# -- the fixed request set -------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A request whose tokens the quiet run knows: greedy, or sampled with a seed."""

    name: str
    token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: tuple[tuple[str, float | int], ...] = ()

    def options(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "max_new_tokens": self.max_new_tokens} | dict(
            self.sampling
        )


@dataclass(frozen=True)
class Conversation:
    """A session's turns (token-id prompts), each greedy."""

    name: str
    turns: tuple[tuple[int, ...], ...]
    max_new_tokens: int


@dataclass(frozen=True)
class Expected:
    token_ids: tuple[int, ...]
    finish_reason: str


def make_cases(
    vocab_size: int, context_length: int, seed: int, n_greedy: int = 10, n_seeded: int = 6
) -> tuple[list[Case], list[Conversation]]:
    """Random token-id prompts of varied lengths, small enough for the context."""
    rng = random.Random(seed)
    low = min(3, vocab_size - 1)  # skip the first ids (usually special tokens)
    max_prompt = max(2, min(48, context_length // 4))
    max_new = max(2, min(24, context_length // 5))

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(low, vocab_size) for _ in range(n))

    cases = [
        Case(f"greedy-{i}", prompt(rng.randint(2, max_prompt)), rng.randint(2, max_new))
        for i in range(n_greedy)
    ]
    cases += [
        Case(
            f"seeded-{i}",
            prompt(rng.randint(2, max_prompt)),
            rng.randint(2, max_new),
            (
                ("temperature", 0.9),
                ("top_k", 40),
                ("top_p", 0.95),
                ("seed", rng.randrange(1 << 31)),
            ),
        )
        for i in range(n_seeded)
    ]
    turns, turn_new = 3, max(2, min(12, context_length // 16))
    turn_len = max(1, min(16, context_length // (2 * turns) - turn_new))
    conversations = [
        Conversation(
            f"conversation-{i}",
            tuple(prompt(rng.randint(1, turn_len)) for _ in range(turns)),
            turn_new,
        )
        for i in range(2)
    ]
    return cases, conversations


def quiet_run(
    client: Client, cases: Sequence[Case], conversations: Sequence[Conversation]
) -> dict[str, Expected]:
    """The expected tokens: every case and conversation alone on the server."""
    expected: dict[str, Expected] = {}
    for case in cases:
        r = client.generate(**case.options())
        expected[case.name] = Expected(r.token_ids, r.finish_reason)
    for conv in conversations:
        with client.session() as session:
            for t, turn in enumerate(conv.turns):
                r = session.generate(token_ids=list(turn), max_new_tokens=conv.max_new_tokens)
                expected[f"{conv.name}/{t}"] = Expected(r.token_ids, r.finish_reason)
    return expected


# -- what the run saw --------------------------------------------------------------


@dataclass
class Ledger:
    """Counts shared by the workers (one lock; every update is a few dict ops)."""

    expected: dict[str, Expected]
    lock: threading.Lock = field(default_factory=threading.Lock)
    kinds: Counter[str] = field(default_factory=Counter)
    rpcs: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    latency_s: dict[str, list[float]] = field(default_factory=dict)
    checked: Counter[str] = field(default_factory=Counter)  # full / prefix comparisons
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[dict[str, Any]] = field(default_factory=list)
    n_mismatches: int = 0
    n_unexpected: int = 0

    def kind(self, kind: str) -> None:
        with self.lock:
            self.kinds[kind] += 1

    def call(
        self, kind: str, rpc: str, code: str, latency_s: float | None, allowed: frozenset[str]
    ) -> None:
        with self.lock:
            self.rpcs[rpc] += 1
            self.outcomes[(rpc, code)] += 1
            if latency_s is not None:
                self.latency_s.setdefault(rpc, []).append(latency_s)
            if code not in allowed:
                self.n_unexpected += 1
                if len(self.unexpected) < MAX_DETAILS:
                    self.unexpected.append({"kind": kind, "rpc": rpc, "code": code})

    def check(
        self, kind: str, name: str, token_ids: Sequence[int], finish_reason: str, complete: bool
    ) -> None:
        """Compare a response with the quiet run: whole if it ran to its end,
        as a prefix if its own cancel or deadline cut it short."""
        want = self.expected[name]
        got = tuple(token_ids)
        if complete:
            ok = got == want.token_ids and finish_reason == want.finish_reason
        else:
            ok = got == want.token_ids[: len(got)]
        with self.lock:
            self.checked["full" if complete else "prefix"] += 1
            if not ok:
                self.n_mismatches += 1
                if len(self.mismatches) < MAX_DETAILS:
                    self.mismatches.append(
                        {
                            "kind": kind,
                            "case": name,
                            "complete": complete,
                            "expected": list(want.token_ids),
                            "expected_finish": want.finish_reason,
                            "got": list(got),
                            "got_finish": finish_reason,
                        }
                    )

    def disagree(self, kind: str, name: str, deltas: Sequence[int], final: Sequence[int]) -> None:
        """The deltas' tokens and the final message's differ: a mismatch too."""
        with self.lock:
            self.n_mismatches += 1
            if len(self.mismatches) < MAX_DETAILS:
                self.mismatches.append(
                    {"kind": kind, "case": name, "deltas": list(deltas), "final": list(final)}
                )

    def total(self) -> int:
        with self.lock:
            return sum(self.kinds.values())


def _code(error: GenAIClientError) -> str:
    return error.code.name


# -- the workers ---------------------------------------------------------------------

OK = frozenset({"OK"})
CUT = frozenset({"OK", "CANCELLED", "DEADLINE_EXCEEDED"})


def ref_chain_schema(links: int) -> dict[str, Any]:
    """A JSON Schema whose $refs chain ``links`` deep (950 overflowed the engine's
    stack; 3,000 in a tool's schema killed the frontend)."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(links)
    }
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(rules: int) -> str:
    """A Lark grammar of ``rules`` chained rules (3,000 crashed the engine)."""
    return (
        "start: r0\n"
        + "".join(f"r{i}: r{i + 1}\n" for i in range(rules - 1))
        + (f'r{rules - 1}: "x"\n')
    )


_REF_CHAIN_950 = ref_chain_schema(950)
_REF_CHAIN_TOOL = {"name": "chained", "description": "", "parameters": ref_chain_schema(3000)}
_RULE_CHAIN_10001 = rule_chain(10_001)  # one rule more than a grammar may have


class Worker:
    """One thread's client and random stream of actions."""

    def __init__(
        self,
        target: str,
        ledger: Ledger,
        cases: Sequence[Case],
        conversations: Sequence[Conversation],
        context_length: int,
        vocab_size: int,
        seed: int,
    ) -> None:
        self.client = Client(target, timeout=CALL_TIMEOUT_S)
        # Raw stubs only for what the client cannot say: a unary call cancelled mid-flight.
        self.raw_channel = grpc.insecure_channel(target)
        self.raw = generate_pb2_grpc.GenerateServiceStub(self.raw_channel)
        self.ledger = ledger
        self.cases = cases
        self.conversations = conversations
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.actions: dict[str, Callable[[], None]] = {
            "unary": self.unary,
            "stream": self.stream,
            "bidi": self.bidi,
            "session": self.session,
            "cancel": self.cancel,
            "deadline": self.deadline,
            "invalid": self.invalid,
            "random": self.random,
        }

    def close(self) -> None:
        self.client.close()
        self.raw_channel.close()

    def run(self, kind: str) -> None:
        self.ledger.kind(kind)
        self.actions[kind]()

    # Each action records its calls; a GenAIClientError is an outcome, not a failure.

    def _timed(
        self, kind: str, rpc: str, allowed: frozenset[str], fn: Callable[[], Any]
    ) -> tuple[Any, str]:
        start = time.perf_counter()
        try:
            value, code = fn(), "OK"
        except GenAIClientError as error:
            value, code = None, _code(error)
        self.ledger.call(kind, rpc, code, time.perf_counter() - start, allowed)
        return value, code

    def unary(self) -> None:
        case = self.rng.choice(self.cases)
        result, _ = self._timed(
            "unary", "Generate", OK, lambda: self.client.generate(**case.options())
        )
        if result is not None:
            self.ledger.check("unary", case.name, result.token_ids, result.finish_reason, True)

    def _stream(
        self, kind: str, case: Case, stop_after: int | None, allowed: frozenset[str], **extra: Any
    ) -> None:
        """Stream ``case``; cancel after ``stop_after`` deltas if given."""
        got: list[int] = []
        start = time.perf_counter()
        code, finish, cut = "OK", "", False
        try:
            with self.client.stream(**case.options(), **extra) as stream:
                for n, delta in enumerate(stream, 1):
                    got.extend(delta.token_ids)
                    if stop_after is not None and n >= stop_after:
                        stream.cancel()
                        code, cut = "CANCELLED", True
                        break
                if not cut:
                    finish = stream.result.finish_reason
                    if list(stream.result.token_ids) != got:
                        self.ledger.disagree(kind, case.name, got, stream.result.token_ids)
        except GenAIClientError as error:
            code, cut = _code(error), True
        self.ledger.call(kind, "GenerateStream", code, time.perf_counter() - start, allowed)
        complete = not cut and finish not in CUT_SHORT
        self.ledger.check(kind, case.name, got, finish, complete)

    def stream(self) -> None:
        self._stream("stream", self.rng.choice(self.cases), None, OK)

    def bidi(self) -> None:
        """Three requests on one call; the first is cancelled after its first delta."""
        start = time.perf_counter()
        code = "OK"
        try:
            with self.client.bidi(timeout=CALL_TIMEOUT_S) as call:
                started: dict[str, Case] = {}
                for _ in range(3):
                    case = self.rng.choice(self.cases)
                    started[call.start(**case.options())] = case
                victim = next(iter(started))
                got: dict[str, list[int]] = {rid: [] for rid in started}
                cancelled = False
                for event in call:
                    rid, case = event.request_id, started[event.request_id]
                    if event.delta is not None:
                        got[rid].extend(event.delta.token_ids)
                        if rid == victim and not cancelled:
                            call.cancel(victim)
                            cancelled = True
                    elif event.result is not None:
                        r = event.result
                        self.ledger.call("bidi", "GenerateBidi.request", "OK", None, OK)
                        # The deltas and the final message must agree.
                        if list(r.token_ids) != got[rid]:
                            self.ledger.disagree("bidi", case.name, got[rid], r.token_ids)
                        complete = r.finish_reason not in CUT_SHORT
                        self.ledger.check("bidi", case.name, r.token_ids, r.finish_reason, complete)
                    elif event.error is not None:
                        allowed = CUT if rid == victim else OK
                        self.ledger.call(
                            "bidi", "GenerateBidi.request", _code(event.error), None, allowed
                        )
        except GenAIClientError as error:
            code = _code(error)
        self.ledger.call("bidi", "GenerateBidi", code, time.perf_counter() - start, OK)

    def session(self) -> None:
        conv = self.rng.choice(self.conversations)
        info, _ = self._timed("session", "CreateSession", OK, self.client.create_session)
        if info is None:
            return
        try:
            for t, turn in enumerate(conv.turns):
                result, _ = self._timed(
                    "session",
                    "Generate(session)",
                    OK,
                    lambda turn=turn: self.client.generate(
                        token_ids=list(turn),
                        max_new_tokens=conv.max_new_tokens,
                        session_id=info.session_id,
                    ),
                )
                if result is None:
                    return
                self.ledger.check(
                    "session", f"{conv.name}/{t}", result.token_ids, result.finish_reason, True
                )
        finally:
            self._timed(
                "session", "CloseSession", OK, lambda: self.client.close_session(info.session_id)
            )

    def cancel(self) -> None:
        case = self.rng.choice(self.cases)
        if self.rng.random() < 0.6:
            self._stream("cancel", case, self.rng.randint(1, 3), CUT)
            return
        # A unary call cancelled by the client after a random short wait.
        request = generate_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=case.token_ids),
            stopping=generate_pb2.StoppingCriteria(max_new_tokens=case.max_new_tokens),
            sampling=generate_pb2.SamplingParams(**dict(case.sampling)),
        )
        start = time.perf_counter()
        future = self.raw.Generate.future(request, timeout=CALL_TIMEOUT_S)
        time.sleep(self.rng.uniform(0.0, 0.05))
        future.cancel()
        code = "OK"
        try:
            response = future.result()
        except grpc.FutureCancelledError:
            code = "CANCELLED"
        except grpc.RpcError as error:
            code = _code(from_rpc_error(error))
        else:
            finish = common_pb2.FinishReason.Name(response.finish_reason).removeprefix(
                "FINISH_REASON_"
            )
            self.ledger.check("cancel", case.name, response.token_ids, finish, True)
        self.ledger.call("cancel", "Generate", code, time.perf_counter() - start, CUT)

    def deadline(self) -> None:
        case = self.rng.choice(self.cases)
        pick = self.rng.random()
        if pick < 0.4:  # a client deadline on a stream
            self._stream("deadline", case, None, CUT, timeout=self.rng.uniform(0.02, 0.3))
        elif pick < 0.7:  # the server-side time limit (FINISH_REASON_TIME_LIMIT)
            self._stream("deadline", case, None, OK, time_limit_ms=self.rng.randint(1, 200))
        else:  # a client deadline on a unary call: nothing comes back before it
            timeout = self.rng.uniform(0.02, 0.3)
            result, _ = self._timed(
                "deadline",
                "Generate",
                CUT,
                lambda: self.client.generate(**case.options(), timeout=timeout),
            )
            if result is not None:
                self.ledger.check(
                    "deadline", case.name, result.token_ids, result.finish_reason, True
                )

    def invalid(self) -> None:
        """Requests the server must refuse with an exact code, never run."""
        ids = list(self.rng.choice(self.cases).token_ids)
        generate = self.client.generate
        unknown = secrets.token_hex(16)  # a well-formed session id nobody created
        bad: list[tuple[str, str, Callable[[], Any]]] = [
            ("INVALID_ARGUMENT", "Generate", lambda: generate(token_ids=ids, temperature=-1.0)),
            ("INVALID_ARGUMENT", "Generate", lambda: generate(token_ids=ids, max_new_tokens=10**7)),
            ("INVALID_ARGUMENT", "Generate", lambda: generate(token_ids=[self.vocab_size + 7])),
            ("INVALID_ARGUMENT", "Generate", lambda: generate(token_ids=[])),
            (
                "INVALID_ARGUMENT",
                "Generate",
                lambda: generate(token_ids=[ids[0]] * (self.context_length + 1)),
            ),
            ("NOT_FOUND", "GetSession", lambda: self.client.get_session(unknown)),
            ("NOT_FOUND", "Generate", lambda: generate(token_ids=ids, session_id=unknown)),
            # Issue 31's hostile shapes: each crashed a process, pinned memory
            # or answered INTERNAL; each is INVALID_ARGUMENT before any token.
            ("INVALID_ARGUMENT", "Generate", lambda: generate("x", json_schema=_REF_CHAIN_950)),
            ("INVALID_ARGUMENT", "Generate", lambda: generate("x", grammar=_RULE_CHAIN_10001)),
            ("INVALID_ARGUMENT", "Generate", lambda: generate("x", regex="a(a{1000}){1000}(zN)?")),
            (
                "INVALID_ARGUMENT",
                "Generate",
                lambda: generate(messages=[("user", "x")], tools=[_REF_CHAIN_TOOL]),
            ),
        ]
        want, rpc, fn = self.rng.choice(bad)
        self._timed("invalid", rpc, frozenset({want}), fn)

    def random(self) -> None:
        """Fuzz: random ids, prompt length, output length and sampling (status
        checked, tokens not); what fills the prefix cache with new chunks."""
        rng = self.rng
        n = rng.randint(1, max(1, min(RANDOM_MAX_PROMPT, self.context_length // 2)))
        options: dict[str, Any] = {
            "token_ids": [rng.randrange(self.vocab_size) for _ in range(n)],
            "max_new_tokens": rng.randint(1, max(1, min(16, self.context_length - n))),
        }
        if rng.random() < 0.5:
            options |= {"temperature": rng.uniform(0.1, 1.5), "top_k": rng.randint(0, 50)}
        if rng.random() < 0.5:
            self._timed("random", "Generate", OK, lambda: self.client.generate(**options))
        else:
            self._timed(
                "random", "GenerateStream", OK, lambda: self.client.stream(**options).collect()
            )


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in KINDS:
            raise ValueError(f"--mix: unknown kind {name!r}; allowed: {', '.join(KINDS)}")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise ValueError(f"--mix: weight of {name!r} is {weight!r}, not a number") from None
        if mix[name] < 0:
            raise ValueError(f"--mix: weight of {name!r} is {mix[name]}, must be >= 0")
    if not any(mix.values()):
        raise ValueError("--mix: at least one kind needs a weight > 0")
    return mix


def worker_loop(
    worker: Worker, mix: dict[str, float], end: float, max_requests: int, stop: threading.Event
) -> None:
    kinds, weights = list(mix), list(mix.values())
    # Each worker's own bound; the run's total is bounded by workers * max_requests.
    for _ in range(max_requests):
        if stop.is_set() or time.monotonic() >= end:
            return
        kind = worker.rng.choices(kinds, weights)[0]
        try:
            worker.run(kind)
        except Exception as exc:  # a bug in this tool or the client: count it, keep going
            worker.ledger.call(kind, "client", f"CLIENT_{type(exc).__name__}", None, OK)


# -- processes and memory ----------------------------------------------------------


def vm_rss(pid: int | None) -> int:
    """Resident set of one process (``VmRSS``) in bytes; 0 if it is gone."""
    return 0 if pid is None else proc_status_bytes(pid, "VmRSS")


def engine_pid(server_pid: int) -> int | None:
    """The engine process: the server's ``spawn`` child (not the resource tracker)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(server_pid).children():
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(child.cmdline())
                if "spawn_main" in cmd:
                    return int(child.pid)
    return None


@dataclass
class Pids:
    frontend: int
    engine: int | None
    kvstore: int

    def rss_mb(self) -> dict[str, float]:
        return {
            "frontend": round(vm_rss(self.frontend) / MB, 1),
            "engine": round(vm_rss(self.engine) / MB, 1),
            "kvstore": round(vm_rss(self.kvstore) / MB, 1),
        }


# Engine gauges next to each RSS sample: what the bounded caches hold.
# The kvstore counters show the data plane was really used (an unauthenticated
# connector would only count errors).
ENGINE_GAUGES = (
    "prefix_cache_bytes",
    "prefix_cache_entries",
    "sessions",
    "kvstore_pushed_chunks",
    "kvstore_errors",
    "kvstore_mac_failures",
)


def engine_gauges(metrics_url: str) -> dict[str, float]:
    """The engine's gauges from the server's ``/metrics`` (polled every ~2 s)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.removeprefix("genai_engine_")
        if key in ENGINE_GAUGES:
            found[key] = float(value)
    return found


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(ledger: Ledger) -> dict[str, Any]:
    latency = {
        rpc: {
            "n": len(v),
            "p50_ms": round(1000 * percentile(v, 0.5), 1),
            "p99_ms": round(1000 * percentile(v, 0.99), 1),
            "mean_ms": round(1000 * statistics.fmean(v), 1),
        }
        for rpc, v in sorted(ledger.latency_s.items())
    }
    by_code: Counter[str] = Counter()
    for (_, code), n in ledger.outcomes.items():
        by_code[code] += n
    return {
        "requests_by_kind": dict(sorted(ledger.kinds.items())),
        "calls_by_rpc": dict(sorted(ledger.rpcs.items())),
        "outcomes_by_code": dict(sorted(by_code.items())),
        "outcomes_by_rpc_and_code": {
            f"{rpc} {code}": n for (rpc, code), n in sorted(ledger.outcomes.items())
        },
        "internal_or_unknown": sum(by_code[c] for c in FAILING),
        "unexpected_codes": ledger.n_unexpected,
        "unexpected_details": ledger.unexpected,
        "token_checks": dict(ledger.checked),
        "token_mismatches": ledger.n_mismatches,
        "mismatch_details": ledger.mismatches,
        "latency": latency,
    }


def print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    out = sys.stdout
    out.write(
        f"\nload: {report['config']['duration_s']} s, {report['config']['workers']} workers, "
    )
    out.write(f"model {report['config']['model']}\n")
    out.write(f"requests by kind:  {s['requests_by_kind']}\n")
    out.write(f"calls by RPC:      {s['calls_by_rpc']}\n")
    out.write(f"outcomes by code:  {s['outcomes_by_code']}\n")
    out.write(f"INTERNAL/UNKNOWN:  {s['internal_or_unknown']}\n")
    out.write(f"unexpected codes:  {s['unexpected_codes']} {s['unexpected_details'][:3]}\n")
    out.write(f"token checks:      {s['token_checks']}\n")
    out.write(f"token mismatches:  {s['token_mismatches']}\n")
    for rpc, lat in s["latency"].items():
        out.write(
            f"  {rpc:<22} n={lat['n']:<6} p50 {lat['p50_ms']:>8} ms  p99 {lat['p99_ms']:>8} ms\n"
        )
    rss = report["rss_mb"]
    for name in ("frontend", "engine", "kvstore"):
        out.write(
            f"RSS {name:<9} boot {rss['boot'][name]:>7} MB  start {rss['start'][name]:>7} MB  "
            f"end {rss['end'][name]:>7} MB\n"
        )
    out.write(f"result: {'PASS' if report['passed'] else 'FAIL'} -> {report['json']}\n")
    out.flush()


# -- main ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.load",
        description=__doc__.split("\n\n")[0],
        epilog="Flags not listed here are passed to genai-server.",
    )
    p.add_argument("--model", default="default", help="model directory, or 'default'")
    p.add_argument("--duration-s", type=float, default=600.0, help="soak length")
    p.add_argument("--workers", type=int, default=8, help="concurrent client threads")
    p.add_argument("--threads", type=int, default=0, help="server --threads (0: one per core)")
    p.add_argument("--mix", default=DEFAULT_MIX, help="relative weights of the request kinds")
    p.add_argument("--seed", type=int, default=0, help="seed of the request set and the workers")
    p.add_argument(
        "--max-requests", type=int, default=1_000_000, help="bound on each worker's actions"
    )
    p.add_argument("--rss-interval-s", type=float, default=10.0, help="RSS sampling period")
    p.add_argument("--kvstore-memory-bytes", default="256MiB")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/load-<time>.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, server_args = build_parser().parse_known_args(argv)
    try:
        mix = parse_mix(args.mix)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.duration_s <= 0 or args.workers < 1:
        print("error: --duration-s must be > 0 and --workers >= 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else RESULTS / f"load-{dt.datetime.now():%Y%m%d-%H%M%S}.json"

    # Imported here: bench.load must not need the test tree to parse --help.
    from tests.kvstore_harness import KvStoreProcess

    # The data-plane token both children read (the kvstore requires it, the
    # server's connector sends it); children inherit this process's environment.
    token = os.environ[AUTH_TOKEN_ENV] = secrets.token_urlsafe(32)
    kvstore = KvStoreProcess("--memory-bytes", args.kvstore_memory_bytes, token=token)
    server: ServerProcess | None = None
    workers: list[Worker] = []
    stop = threading.Event()
    try:
        kvstore.start()
        assert kvstore.proc is not None
        metrics_port = free_port()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        server = ServerProcess(
            args.model,
            args.threads,
            start_timeout_s=args.start_timeout_s,
            extra_args=[
                "--kvstore", kvstore.target, "--metrics-port", str(metrics_port), *server_args
            ],
        )  # fmt: skip
        pids = Pids(server.proc.pid, engine_pid(server.proc.pid), kvstore.proc.pid)
        rss_boot = pids.rss_mb()
        with Client(server.target, timeout=CALL_TIMEOUT_S) as client:
            info = client.model_info()
            cases, conversations = make_cases(info.vocab_size, info.context_length, args.seed)
            try:
                expected = quiet_run(client, cases, conversations)
            except GenAIClientError as exc:
                print(f"error: the quiet run failed: {exc}\n{server.log_tail()}", file=sys.stderr)
                return 2
        ledger = Ledger(expected)
        workers = [
            Worker(
                server.target,
                ledger,
                cases,
                conversations,
                info.context_length,
                info.vocab_size,
                seed=args.seed * 1000 + i + 1,
            )
            for i in range(args.workers)
        ]
        rss_start = pids.rss_mb()
        samples = [{"t_s": 0.0, "requests": 0, **rss_start, **engine_gauges(metrics_url)}]
        started = time.monotonic()
        end = started + args.duration_s
        threads = [
            threading.Thread(
                target=worker_loop,
                args=(w, mix, end, args.max_requests, stop),
                name=f"load-{i}",
                daemon=True,
            )
            for i, w in enumerate(workers)
        ]
        for t in threads:
            t.start()
        next_sample = started + args.rss_interval_s
        # Bounded: the workers stop at ``end``; each call is bounded by CALL_TIMEOUT_S.
        give_up = end + CALL_TIMEOUT_S + 30
        while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
            time.sleep(0.2)
            if time.monotonic() >= next_sample:
                next_sample += args.rss_interval_s
                elapsed = round(time.monotonic() - started, 1)
                samples.append(
                    {
                        "t_s": elapsed,
                        "requests": ledger.total(),
                        **pids.rss_mb(),
                        **engine_gauges(metrics_url),
                    }
                )
        hung = [t.name for t in threads if t.is_alive()]
        elapsed = time.monotonic() - started
        rss_end = pids.rss_mb()
        samples.append(
            {
                "t_s": round(elapsed, 1),
                "requests": ledger.total(),
                **rss_end,
                **engine_gauges(metrics_url),
            }
        )
        s = summary(ledger)
        passed = (
            not hung
            and s["internal_or_unknown"] == 0
            and s["token_mismatches"] == 0
            and s["unexpected_codes"] == 0
        )
        report = {
            "when": dt.datetime.now().isoformat(timespec="seconds"),
            "config": {
                "model": args.model,
                "duration_s": args.duration_s,
                "workers": args.workers,
                "threads": args.threads,
                "mix": mix,
                "seed": args.seed,
                "server_args": server_args,
                "cases": len(cases),
                "conversations": len(conversations),
            },
            "elapsed_s": round(elapsed, 1),
            "hung_workers": hung,
            "summary": s,
            "rss_mb": {"boot": rss_boot, "start": rss_start, "end": rss_end},
            "rss_samples": samples,
            "passed": passed,
            "json": str(out),
            "machine": machine_info(),
            "versions": versions(),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print_report(report)
        if not passed and server is not None:
            print(server.log_tail(), file=sys.stderr)
        return 0 if passed else 1
    except KeyboardInterrupt:
        print("interrupted; stopping the server and the kvstore", file=sys.stderr)
        return 130
    finally:
        stop.set()
        for w in workers:
            with contextlib.suppress(Exception):
                w.close()
        if server is not None:
            server.stop()
        kvstore.stop()


if __name__ == "__main__":
    sys.exit(main())
