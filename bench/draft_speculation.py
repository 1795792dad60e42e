"""``python -m bench.draft_speculation``: speculative decoding with a draft model,
through real ``genai-server`` processes, on the fp32 conversion of the default model.

    python -m bench.draft_speculation                # 3 reps, 6 prompts, 256 new tokens
    python -m bench.draft_speculation --quick        # 1 rep, 2 prompts, 64 new tokens
    python -m bench.draft_speculation --reps 5 --k 4 --threads 2

The target is the fp32 graph of the default GGUF (what a user runs for full
precision); every engine below is its own ``genai-server`` on it, all started
up front, and each rep's runs take turns across them (the order rotated from
run to run) so that drift hits every engine alike:

- ``plain``: no speculation;
- ``draft_int4``: ``--draft-model <int4> --speculate K --speculative-mode draft``,
  the int4 conversion of the same GGUF (the file's own Q4_1 blocks: the draft
  that agrees with fp32 most often);
- ``draft_int8``: the same with the int8 conversion as draft;
- ``poor_draft``: the same with a deliberately poor draft, the default GGUF's
  first 4 of its 30 layers at int4. A bench-only draft: ``poor_draft_dir``
  converts it once (the converter patched to build 4 layers and to leave the
  other layers' tensors unread), into the cache beside the default model's
  conversions; nothing outside this module makes or serves it;
- ``draft_int4_batch4``: ``draft_int4`` with ``--speculate-max-batch 4``
  (speculation allowed at up to 4 streams; the default allows it at 1 only),
  under the measured batch rule that speculates at a batch size only while
  that is the faster way there;
- ``draft_int4_batch4_always``: the same with ``--speculate-batch-rule
  always``: every step at up to 4 streams speculates.

Workload: 6 chat prompts (the model's chat template; stories and
explanations, free text: nothing to copy), ``--new-tokens`` (256) each with
EOS ignored, greedy and sampled (temperature 0.7, a fixed seed per prompt);
every request has its own ``cache_salt``, so every prefill is cold. Shapes:
single streams (each prompt alone: plain, both good drafts, the poor one) and
4 concurrent streams (4 different prompts at once: plain, ``draft_int4``,
``draft_int4_batch4``, ``draft_int4_batch4_always``).

Per engine, shape and sampling: median decode tok/s (single: ``stream_stats``;
4 streams: the aggregate of ``concurrency_stats``), median TTFT, the ratio to
``plain`` in the same rep (median over reps), the acceptance rate
f = accepted / draft tokens from the server's ``/metrics`` (the difference of
``genai_engine_spec_{draft,accepted}_tokens{proposer="draft"}`` over the shape),
and how many token lists equal plain's (every one must).

Cost model, in a child process (the shared ORT thread pool it makes, as a
server's engine process does beside a draft, is process-wide for good): with
``create_runner(..., RunnerConfig(shared_thread_pool=True), max_slots=4)``,
the median ms of a one-token decode step at 100 tokens of context for fp32,
int8, int4 and the poor draft, and of the target's check of K+1 tokens
(``runner.verify``). c = draft step / target step. A guess is at most K
tokens and, for greedy requests, ends earlier after a token the draft doubts
(``--draft-min-confidence``) or, after a guess rejected whole, at half the
last one's bound, so the model reads the guesses as they were
from the server's counters (``genai_engine_spec_guesses``, ``..._draft_tokens``,
``..._accepted_tokens``, proposer "draft"): L = draft tokens / guesses, the
mean guess, and E = 1 + accepted / guesses, the tokens per check. A round
costs L draft steps and a check of L + 1 tokens, whose cost is taken linear
between a one-token step and the K+1-token check:
T_check(L) = T_target + (T_verify − T_target) · L / K. The expected speed-up
is E · T_target / (L · T_draft + T_check(L)).

``measure() -> dict`` and ``markdown(result) -> list[str]`` are the API for
``bench.run`` (section "draft_speculation").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from .procs import REPO, free_port
from .workload import TokenSource, concurrency_stats, median, stream_stats

# Draft tokens per check at most (--k); greedy guesses end earlier where the draft
# doubts a token (--draft-min-confidence at its default), and a sequence whose guess was
# rejected whole guesses half as far next (docs/design.md, "Speculative decoding").
K = 10
POOR_LAYERS = 4  # layers the poor draft keeps, of the default model's 30
COST_CONTEXT = 100  # tokens of context of the cost model's steps
COST_ROUNDS = 40
CALL_TIMEOUT_S = 300.0  # one request's deadline
STREAMS = 4
TEMPERATURE = 0.7
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a rainbow forms, in simple words.",
    "Write a story about a robot who is learning to paint.",
    "Explain to a ten-year-old why the sky is blue.",
    "Tell me a story about a cat that runs the village post office.",
    "Explain how yeast makes bread rise.",
)
SAMPLINGS = ("greedy", "sampled")
# Targets (measured / limit): the good drafts single-stream, speculation forced
# at 4 streams, the poor draft single-stream (never much slower than plain).
GOOD_SINGLE = 1.6
GOOD_STREAMS = 1.2
POOR_SINGLE = 0.95


@dataclass(frozen=True)
class Engine:
    name: str
    draft: str | None = None  # key of the model directories: int4, int8, poor
    max_batch: int = 1  # --speculate-max-batch
    rule: str = "measured"  # --speculate-batch-rule


ENGINES = (
    Engine("plain"),
    Engine("draft_int4", "int4"),
    Engine("draft_int8", "int8"),
    Engine("poor_draft", "poor"),
    Engine("draft_int4_batch4", "int4", STREAMS),
    Engine("draft_int4_batch4_always", "int4", STREAMS, "always"),
)
SINGLE = ("plain", "draft_int4", "draft_int8", "poor_draft")
MULTI = ("plain", "draft_int4", "draft_int4_batch4", "draft_int4_batch4_always")
LABELS = {
    "plain": "fp32, no speculation",
    "draft_int4": "fp32 + int4 draft",
    "draft_int8": "fp32 + int8 draft",
    "poor_draft": f"fp32 + poor draft ({POOR_LAYERS} layers, int4)",
    "draft_int4_batch4": "fp32 + int4 draft, --speculate-max-batch 4",
    "draft_int4_batch4_always": "fp32 + int4 draft, --speculate-max-batch 4 "
    "--speculate-batch-rule always",
}
COST_MODELS = {"fp32": "fp32 (target)", "int8": "int8", "int4": "int4", "poor": "poor draft"}


# -- the models ------------------------------------------------------------------


def _dropped_layer(name: str) -> bool:
    """A tensor of one of the layers the poor draft leaves out."""
    m = re.match(r"blk\.(\d+)\.", name)
    return m is not None and int(m[1]) >= POOR_LAYERS


def poor_draft_dir() -> Path:
    """The bench-only poor draft: the default GGUF's first ``POOR_LAYERS`` layers
    at int4, converted once into the default model's cache (reused when there).

    ``GGUFModel.decoder_params`` is patched for the call to say ``POOR_LAYERS``
    layers, so the graph builder reads ``blk.0..3`` only; ``build_decoder``
    refuses a file with unread tensors, so ``unused_tensors`` is patched to
    leave out those of the dropped layers (any other unread one still refuses).
    """
    from genai_service.convert.convert import CONVERTER_VERSION, ConvertOptions, convert
    from genai_service.convert.default_model import default_cache_dir, default_gguf
    from genai_service.convert.gguf_model import GGUFModel
    from genai_service.model.model_dir import load_model_spec

    target = default_cache_dir() / f"bench-poor-draft-{POOR_LAYERS}-layers-v{CONVERTER_VERSION}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params_of, unused_of = GGUFModel.decoder_params, GGUFModel.unused_tensors

    def few_layers(self: GGUFModel) -> Any:
        return dataclasses.replace(params_of(self), n_layers=POOR_LAYERS)

    def unused_kept(self: GGUFModel) -> list[str]:
        return [name for name in unused_of(self) if not _dropped_layer(name)]

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with (
            mock.patch.object(GGUFModel, "decoder_params", few_layers),
            mock.patch.object(GGUFModel, "unused_tensors", unused_kept),
        ):
            convert(default_gguf().path, tmp, ConvertOptions(weights="int4"), progress=False)
        layers = load_model_spec(tmp).kv.num_layers
        if layers != POOR_LAYERS:
            raise RuntimeError(f"the poor draft has {layers} layers, not {POOR_LAYERS}")
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # not another process's conversion renamed first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def model_dirs() -> dict[str, str]:
    """The target (fp32) and the drafts: the default GGUF's conversions."""
    from genai_service.convert.default_model import resolve_model

    dirs = {
        w: str(resolve_model("default", weights=w, progress=False))
        for w in ("fp32", "int8", "int4")
    }
    dirs["poor"] = str(poor_draft_dir())
    return dirs


# -- the cost model (in a child process) ----------------------------------------------


def cost_model(dirs: dict[str, str], threads: int, k: int, rounds: int = COST_ROUNDS) -> dict:
    """Median ms of a one-token decode step at ``COST_CONTEXT`` tokens of context
    per model, and of the target's check of ``k + 1`` tokens; in this process
    (which it leaves with ORT's process-wide thread pool: call it in a child)."""
    from genai_service.config import RunnerConfig
    from genai_service.engine.runner.runners import create_runner
    from genai_service.engine.runner.step_item import StepItem
    from genai_service.model.model_dir import load_model_spec

    config = RunnerConfig(intra_op_threads=threads, shared_thread_pool=True)
    specs = {name: load_model_spec(d) for name, d in dirs.items()}
    runners = {
        name: create_runner(spec, config, max_slots=4, max_len=2048) for name, spec in specs.items()
    }
    ids = TokenSource(dirs["fp32"], lines=80).take(COST_CONTEXT)
    for runner in runners.values():
        runner.run([StepItem(0, ids, 0)])
    tok, n = ids[-1], COST_CONTEXT

    def step(runner: Any) -> None:
        runner.run([StepItem(0, [tok], n)])
        runner.truncate(0, n)

    def check(runner: Any) -> None:
        runner.verify(StepItem(0, [tok] * (k + 1), n))
        runner.truncate(0, n)

    calls: dict[str, Callable[[], None]] = {
        name: (lambda r=runner: step(r)) for name, runner in runners.items()
    }
    calls["fp32_verify"] = lambda: check(runners["fp32"])
    for _ in range(5):  # warm-up: first runs of a shape cost more
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    items = list(calls.items())
    for i in range(rounds):  # each round every call once, in a rotated order
        for name, call in items[i % len(items) :] + items[: i % len(items)]:
            started = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - started) * 1e3)
    for runner in runners.values():
        runner.release(0)
    step_ms = {name: median(times[name]) for name in runners}
    return {
        "context": COST_CONTEXT,
        "k": k,
        "threads": threads,
        "rounds": rounds,
        "layers": {name: spec.kv.num_layers for name, spec in specs.items()},
        "step_ms": step_ms,
        "verify_ms": median(times["fp32_verify"]),
        "c": {name: step_ms[name] / step_ms["fp32"] for name in runners if name != "fp32"},
    }


def _cost_model_child(dirs: dict[str, str], threads: int, k: int, timeout_s: float = 600) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-draft-cost-") as tmp:
        out = Path(tmp) / "cost.json"
        cmd = [
            sys.executable, "-m", "bench.draft_speculation",
            "--cost-model-out", str(out),
            "--cost-model-dirs", json.dumps(dirs),
            "--threads", str(threads),
            "--k", str(k),
        ]  # fmt: skip
        done = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"cost model exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"
            )
        result: dict = json.loads(out.read_text())
        return result


def expected_speedup(
    guesses: float,
    drafted: float,
    accepted: float,
    k: int,
    target_ms: float,
    draft_ms: float,
    verify_ms: float,
) -> tuple[float, float, float]:
    """(L, E, E · T_target / (L · T_draft + T_check(L))) for the observed guesses:
    L = drafted / guesses, E = 1 + accepted / guesses, T_check linear in L
    between a one-token step (0) and the K+1-token check (K)."""
    if not guesses:
        return float("nan"), float("nan"), float("nan")
    mean, e = drafted / guesses, 1 + accepted / guesses
    check_ms = target_ms + (verify_ms - target_ms) * mean / k
    return mean, e, e * target_ms / (mean * draft_ms + check_ms)


# -- the servers -----------------------------------------------------------------


@dataclass
class Running:
    engine: Engine
    server: Any  # ours.ServerProcess
    client: Any  # genai_client.Client
    metrics_port: int
    info: dict


_SPEC = re.compile(
    r'^genai_engine_spec_(guesses|draft_tokens|accepted_tokens)\{proposer="draft"\} '
    r"([0-9.eE+-]+)$",
    re.M,
)
_salts = itertools.count()


def _salt() -> str:
    """A fresh ``cache_salt``: no request reuses another's prompt KV."""
    return f"bench-draft-{os.getpid()}-{next(_salts)}"


Counts = tuple[float, float, float]  # the draft proposer's draft tokens, accepted, guesses


def _spec_counts(port: int) -> Counts:
    """The draft proposer's counters on one server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = {m[1]: float(m[2]) for m in _SPEC.finditer(text)}
    return (
        found.get("draft_tokens", 0.0),
        found.get("accepted_tokens", 0.0),
        found.get("guesses", 0.0),
    )


def _counters(running: dict[str, Running]) -> dict[str, Counts]:
    """Every server's counters once they are settled: the frontend polls the
    engine's every 0.5 s, so read until two reads 0.6 s apart agree (bounded)."""
    time.sleep(1.0)
    last = {name: _spec_counts(r.metrics_port) for name, r in running.items()}
    for _ in range(10):
        time.sleep(0.6)
        now = {name: _spec_counts(r.metrics_port) for name, r in running.items()}
        if now == last:
            break
        last = now
    return last


def _start(engine: Engine, dirs: dict[str, str], threads: int, k: int) -> Running:
    from genai_client import Client

    from .ours import ServerProcess

    port = free_port()
    args = ["--metrics-port", str(port)]
    if engine.draft is not None:
        args += [
            "--draft-model", dirs[engine.draft],
            "--speculate", str(k),
            "--speculative-mode", "draft",
            "--speculate-max-batch", str(engine.max_batch),
            "--speculate-batch-rule", engine.rule,
        ]  # fmt: skip
    server = ServerProcess(dirs["fp32"], threads, start_timeout_s=300, extra_args=args)
    try:
        client = Client(server.target, timeout=CALL_TIMEOUT_S)
        info = client.model_info()
    except BaseException:
        server.stop()
        raise
    running = Running(
        engine,
        server,
        client,
        port,
        {
            "model_id": info.model_id,
            "speculative_mode": info.speculative_mode,
            "speculative_tokens": info.speculative_tokens,
            "draft_model_id": info.draft_model_id,
        },
    )
    if engine.draft is not None and (
        info.speculative_mode.lower() != "draft" or info.speculative_tokens != k
    ):
        _stop(running)
        raise RuntimeError(f"{engine.name}: the server does not draft with a model: {info}")
    return running


def _stop(running: Running) -> None:
    try:
        running.client.close()
    finally:
        running.server.stop()


# -- one request, N requests -------------------------------------------------------


def _single(client: Any, ids: Sequence[int], new_tokens: int, params: dict) -> tuple[dict, list]:
    """One GenerateStream call: ``stream_stats`` and every token id."""
    times: list[float] = []
    counts: list[int] = []
    tokens: list[int] = []
    submit = time.perf_counter()
    stream = client.stream(
        token_ids=list(ids),
        max_new_tokens=new_tokens,
        ignore_eos=True,
        cache_salt=_salt(),
        timeout=CALL_TIMEOUT_S,
        **params,
    )
    for delta in stream:
        if delta.token_ids:
            times.append(time.perf_counter())
            counts.append(len(delta.token_ids))
            tokens.extend(delta.token_ids)
    return stream_stats(submit, times, counts), tokens


async def _concurrent_async(
    target: str, prompts: Sequence[Sequence[int]], new_tokens: int, params: Sequence[dict]
) -> tuple[dict, list[list[int]]]:
    from genai_client import AsyncClient

    async with AsyncClient(target) as client:
        await client.model_info()  # connect before the clock starts

        async def one(ids: Sequence[int], p: dict) -> tuple[dict, list[int]]:
            first = last = 0.0
            tokens: list[int] = []
            stream = client.stream(
                token_ids=list(ids),
                max_new_tokens=new_tokens,
                ignore_eos=True,
                cache_salt=_salt(),
                timeout=CALL_TIMEOUT_S,
                **p,
            )
            async for delta in stream:
                if delta.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    tokens.extend(delta.token_ids)
            return {"first": first, "last": last, "tokens": len(tokens)}, tokens

        submit = time.perf_counter()
        done = await asyncio.gather(*(one(ids, p) for ids, p in zip(prompts, params, strict=True)))
    return concurrency_stats(submit, [s for s, _ in done]), [t for _, t in done]


def _concurrent(
    target: str, prompts: Sequence[Sequence[int]], new_tokens: int, params: Sequence[dict]
) -> tuple[dict, list[list[int]]]:
    """All prompts at once, one GenerateStream each: ``concurrency_stats`` and
    each stream's token ids."""
    return asyncio.run(_concurrent_async(target, prompts, new_tokens, params))


def _params(sampling: str, prompt: int) -> dict:
    """Sampling keyword arguments; a fixed seed per prompt when sampled."""
    return {} if sampling == "greedy" else {"temperature": TEMPERATURE, "seed": 1000 + prompt}


class _Turns:
    """The engines of each run in an order rotated from run to run."""

    def __init__(self) -> None:
        self.turn = 0

    def __call__(self, names: Sequence[str]) -> list[str]:
        k = self.turn % len(names)
        self.turn += 1
        return [*names[k:], *names[:k]]


# -- the measurement ------------------------------------------------------------------


def _shape_row(
    name: str,
    per_rep: list[list[dict]],
    plain_per_rep: list[list[dict]],
    rate_key: str,
    ttft_key: str,
    counts: Counts,
    same: tuple[int, int],
) -> dict:
    """One engine's row of a shape and sampling: medians, the per-rep ratio to
    plain, the acceptance over the shape, identical token lists."""
    rates = [[r[rate_key] for r in rep] for rep in per_rep]
    ratios = [
        median(mine) / median([r[rate_key] for r in plain])
        for mine, plain in zip(rates, plain_per_rep, strict=True)
    ]
    drafted, accepted, guesses = counts
    return {
        "decode_tok_s": median([x for rep in rates for x in rep]),
        "ttft_s": median([r[ttft_key] for rep in per_rep for r in rep]),
        "ratio": median(ratios),
        "ratio_per_rep": ratios,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "guesses": guesses,
        "acceptance": accepted / drafted if drafted else float("nan"),
        "identical": same[0],
        "compared": same[1],
        "runs": [
            [{k: v for k, v in r.items() if k != "token_ids"} for r in rep] for rep in per_rep
        ],
    }


def _diff(after: Counts, before: Counts) -> Counts:
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


def _run_shape(
    running: dict[str, Running],
    names: Sequence[str],
    turns: _Turns,
    reps: int,
    runs_of_rep: Callable[[int], list[tuple[str, Callable[[Running], tuple[dict, Any]]]]],
    rate_key: str,
    ttft_key: str,
) -> dict:
    """Every rep's runs (``runs_of_rep(rep)``: (run id, call on a server)), each
    on every engine in turn; rows by engine, with the counters' difference."""
    shape = {n: running[n] for n in names}
    before = _counters(shape)
    stats: dict[str, list[list[dict]]] = {n: [] for n in names}
    tokens: dict[str, dict[str, Any]] = {n: {} for n in names}
    for rep in range(reps):
        for n in names:
            stats[n].append([])
        for run_id, call in runs_of_rep(rep):
            for n in turns(names):
                result, toks = call(shape[n])
                stats[n][-1].append(result)
                tokens[n][run_id] = toks
    after = _counters(shape)
    rows = {}
    for n in names:
        pairs = [(tokens[n][rid], tokens["plain"][rid]) for rid in tokens["plain"]]
        if rate_key == "agg_tok_s":  # per stream
            pairs = [(a, b) for x, y in pairs for a, b in zip(x, y, strict=True)]
        same = (sum(a == b for a, b in pairs), len(pairs))
        rows[n] = _shape_row(
            n, stats[n], stats["plain"], rate_key, ttft_key, _diff(after[n], before[n]), same
        )
    return rows


def measure(
    reps: int = 3,
    threads: int = 2,
    k: int = K,
    new_tokens: int = 256,
    prompts: int = len(PROMPTS),
    quick: bool = False,
) -> dict:
    """The section: model directories, the cost model, then the servers' shapes.
    ``quick``: 1 rep, 2 prompts, 64 new tokens (a smoke test)."""
    if quick:
        reps, prompts, new_tokens = 1, 2, 64
    started = time.perf_counter()
    dirs = model_dirs()
    source = TokenSource(dirs["fp32"], lines=10)
    chats = [source.chat(p) for p in PROMPTS]
    singles = list(range(min(prompts, len(PROMPTS))))
    groups = [[(STREAMS * rep + j) % len(PROMPTS) for j in range(STREAMS)] for rep in range(reps)]
    cost = _cost_model_child(dirs, threads, k)

    running: dict[str, Running] = {}
    turns = _Turns()
    single: dict[str, dict] = {}
    multi: dict[str, dict] = {}
    try:
        for engine in ENGINES:
            running[engine.name] = _start(engine, dirs, threads, k)
        for r in running.values():  # warm-up: a stream alone, then 4 at once
            _single(r.client, chats[0], 8, {})
            if r.engine.name in MULTI:
                _concurrent(r.server.target, [chats[i] for i in groups[0]], 8, [{}] * STREAMS)
        for sampling in SAMPLINGS:

            def single_runs(rep: int, s: str = sampling) -> list:
                return [
                    (
                        f"{rep}/{i}",
                        lambda r, i=i: _single(r.client, chats[i], new_tokens, _params(s, i)),
                    )
                    for i in singles
                ]

            def multi_runs(rep: int, s: str = sampling) -> list:
                ids = [chats[i] for i in groups[rep]]
                params = [_params(s, i) for i in groups[rep]]
                return [(str(rep), lambda r: _concurrent(r.server.target, ids, new_tokens, params))]

            single[sampling] = _run_shape(
                running, SINGLE, turns, reps, single_runs, "decode_tok_s", "ttft_s"
            )
            multi[sampling] = _run_shape(
                running, MULTI, turns, reps, multi_runs, "agg_tok_s", "ttft_p50_s"
            )
    finally:
        for r in running.values():
            _stop(r)

    for rows in single.values():
        for name, row in rows.items():
            engine = next(e for e in ENGINES if e.name == name)
            if engine.draft is None:
                continue
            row["mean_guess"], row["tokens_per_check"], row["expected_ratio"] = expected_speedup(
                row["guesses"],
                row["draft_tokens"],
                row["accepted_tokens"],
                k,
                cost["step_ms"]["fp32"],
                cost["step_ms"][engine.draft],
                cost["verify_ms"],
            )
    result = {
        "k": k,
        "threads": threads,
        "reps": reps,
        "new_tokens": new_tokens,
        "streams": STREAMS,
        "temperature": TEMPERATURE,
        "quick": quick,
        "prompts": [PROMPTS[i] for i in singles],
        "prompt_tokens": [len(chats[i]) for i in singles],
        "stream_groups": groups,
        "models": dirs,
        "servers": {name: r.info for name, r in running.items()},
        "cost_model": cost,
        "single": single,
        "streams4": multi,
        "elapsed_s": time.perf_counter() - started,
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> list[dict]:
    """The section's targets: each measured value against its limit (all ``>=``)."""
    out = []

    def add(name: str, measured: float, limit: float, headline: bool = False) -> None:
        met = None if measured != measured else bool(measured >= limit)
        out.append(
            {
                "target": name,
                "measured": measured,
                "limit": limit,
                "unit": "×",
                "met": met,
                "headline": headline,
            }
        )

    single, multi = result["single"], result["streams4"]
    for sampling in SAMPLINGS:
        for name in ("draft_int4", "draft_int8"):
            add(
                f"fp32 + {name[6:]} draft, single stream ({sampling}): decode ≥ {GOOD_SINGLE}× "
                "plain fp32",
                single[sampling][name]["ratio"],
                GOOD_SINGLE,
                headline=name == "draft_int4" and sampling == "greedy",
            )
    for sampling in SAMPLINGS:
        add(
            f"fp32 + int4 draft, {STREAMS} streams, --speculate-max-batch {STREAMS} ({sampling}): "
            f"aggregate ≥ {GOOD_STREAMS}× plain fp32",
            multi[sampling]["draft_int4_batch4"]["ratio"],
            GOOD_STREAMS,
        )
    for sampling in SAMPLINGS:
        add(
            f"fp32 + a poor draft ({POOR_LAYERS} layers), single stream ({sampling}): decode ≥ "
            f"{POOR_SINGLE}× plain fp32",
            single[sampling]["poor_draft"]["ratio"],
            POOR_SINGLE,
        )
    rows = [row for shape in (single, multi) for by in shape.values() for row in by.values()]
    same = sum(row["identical"] for row in rows)
    total = sum(row["compared"] for row in rows)
    add(
        "draft speculation: every token list identical to plain fp32's (fraction)",
        same / total if total else float("nan"),
        1.0,
    )
    return out


# -- the report ---------------------------------------------------------------------


def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown(result: dict[str, Any]) -> list[str]:
    r = result
    k, cost = r["k"], r["cost_model"]
    lines = [
        f"Target: the default GGUF converted to fp32; drafts: its int4 and int8 conversions "
        f"and a bench-only poor draft (its first {POOR_LAYERS} layers, int4); at most K = {k} "
        f"draft tokens per check (`--speculate {k}`, the confidence stop at its default); "
        f"every engine its own `genai-server` ({r['threads']} intra-op "
        f"threads), the runs of each rep taking turns across them. {len(r['prompts'])} chat "
        f"prompts (stories, explanations), {r['new_tokens']} new tokens, EOS ignored, greedy "
        f"and sampled (temperature {r['temperature']}, a seed per prompt), no prompt KV reused; "
        f"median of {r['reps']} rep(s). × plain: the median over reps of the rep's ratio. "
        "Acceptance f: accepted / draft tokens (the server's counters over the shape); "
        "expected ×: the cost model's (below) for those guesses; identical: token lists equal to "
        "plain's.",
        "",
    ]
    header = "| engine | sampling | decode tok/s | × plain | expected × | TTFT s | acceptance f "
    lines += [
        "**Single stream** (each prompt alone)",
        "",
        header + "| identical tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in SINGLE:
        for sampling in SAMPLINGS:
            row = r["single"][sampling][name]
            lines.append(
                f"| {LABELS[name]} | {sampling} | {_f(row['decode_tok_s'], 1)} | "
                f"{_f(row['ratio'])} | {_f(row.get('expected_ratio'))} | "
                f"{_f(row['ttft_s'], 3)} | {_f(row['acceptance'])} | "
                f"{row['identical']}/{row['compared']} |"
            )
    lines += [
        "",
        f"**{r['streams']} concurrent streams** ({r['streams']} different prompts at once; "
        "aggregate tok/s, first submit to last token; TTFT p50)",
        "",
        "| engine | sampling | aggregate tok/s | × plain | TTFT p50 s | acceptance f "
        "| identical tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in MULTI:
        for sampling in SAMPLINGS:
            row = r["streams4"][sampling][name]
            lines.append(
                f"| {LABELS[name]} | {sampling} | {_f(row['decode_tok_s'], 1)} | "
                f"{_f(row['ratio'])} | {_f(row['ttft_s'], 3)} | {_f(row['acceptance'])} | "
                f"{row['identical']}/{row['compared']} |"
            )
    target_ms = cost["step_ms"]["fp32"]
    lines += [
        "",
        f"**Cost model** (in-process runners sharing one thread pool, as in a server beside a "
        f"draft; one-token decode step at {cost['context']} tokens of context, median of "
        f"{cost['rounds']}). The fp32 target's check of {k + 1} tokens: "
        f"{_f(cost['verify_ms'])} ms ({_f(cost['verify_ms'] / target_ms)}× its step). "
        "From the single-stream counters: L = draft tokens / guesses (the mean guess; at "
        "most K, shorter where the draft doubted a token of a greedy guess, after a guess "
        "rejected whole, or for want of room), E = 1 + accepted / guesses "
        "(tokens per check); expected × = E·T_target / (L·c·T_target + T_check(L)), "
        "T_check(L) = T_target + (T_verify − T_target)·L/K.",
        "",
        "| model | layers | step ms | c = step / target's | L greedy | E greedy "
        "| expected × greedy | L sampled | E sampled | expected × sampled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, label in COST_MODELS.items():
        cells = [
            label,
            str(cost["layers"][model]),
            _f(cost["step_ms"][model]),
            _f(cost["c"].get(model, 1.0)),
        ]
        engine = {"int4": "draft_int4", "int8": "draft_int8", "poor": "poor_draft"}.get(model)
        for sampling in SAMPLINGS:
            row = r["single"][sampling][engine] if engine else {}
            cells += [
                _f(row.get("mean_guess")),
                _f(row.get("tokens_per_check")),
                _f(row.get("expected_ratio")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""]
    for t in r["targets"]:
        met = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"- {t['target']}: {_f(t['measured'])} (limit {_f(t['limit'])}) — {met}")
    modes = {n: s["speculative_mode"] or "off" for n, s in r["servers"].items()}
    lines += [
        "",
        "Servers' GetModelInfo speculative_mode: "
        + ", ".join(f"{n} {m}" for n, m in modes.items())
        + f"; {r['elapsed_s'] / 60:.1f} min in all.",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=K, help="draft tokens per check")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="single-stream prompts")
    ap.add_argument("--quick", action="store_true", help="1 rep, 2 prompts, 64 new tokens")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cost-model-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cost-model-dirs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps < 1 or not 1 <= args.k <= 32:
        raise SystemExit("--reps must be >= 1 and --k in [1, 32]")
    if args.cost_model_out is not None:  # the child process of _cost_model_child
        dirs = json.loads(args.cost_model_dirs)
        args.cost_model_out.write_text(json.dumps(cost_model(dirs, args.threads, args.k)))
        return 0
    result = measure(
        reps=args.reps,
        threads=args.threads,
        k=args.k,
        new_tokens=args.new_tokens,
        prompts=args.prompts,
        quick=args.quick,
    )
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parent / "results" / f"draft_speculation-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
