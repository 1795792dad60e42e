"""The frontend's CPU per streamed token, next to a bare grpc.aio streaming servicer's.

    python -m bench.frontend_profile [--model default|tiny|DIR] [--tokens N] [--reps R]
                                     [--streams 1,8] [--stream-interval N] [--py-spy OUT.txt]
                                     [--baseline DIR] [--bare-interval-ms MS] [--no-bare]

Starts a real ``genai-server`` on the default model (one token per message at
its real step rate; the tiny test model steps so fast that the frontend falls
behind and merges steps, which measures something else), streams ``--tokens``
new tokens on each of 1 and 8 concurrent ``GenerateStream`` calls, and reads
the frontend process's CPU time (``/proc/PID/stat`` utime + stime, every
thread) before and after: CPU per streamed token is the difference over the
tokens the client received. The
engine process's CPU per token is reported alongside. Then the same client
against a bare grpc.aio servicer of ``GenerateService.GenerateStream`` (in
its own process) that yields one ``Delta`` per token and a ``Final``: gRPC's
own per-message cost, the floor the frontend is measured against, paced at
``--bare-interval-ms`` per token like an engine step (unpaced, gRPC coalesces
writes and costs several times less per message). ``--baseline DIR`` also
runs the server from another checkout (a worktree of main, its stubs built),
the two taking turns rep by rep: an A/B on a shared machine.

Medians over ``--reps``; the machine may be shared, so read the numbers as
that (``load`` in the output is the load average when each row started).
``--py-spy FILE`` records the frontend under py-spy (installed into the venv)
for one run on the fewest streams and writes its busy samples to FILE, by
category (pipe read + unpickle, demux, queue hand-off, protobuf, gRPC, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from genai_proto.genai.v1 import common_pb2, generate_pb2, generate_pb2_grpc

from .ours import ServerProcess
from .procs import REPO, free_port, stop_tree

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT = list(range(10, 42))


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def engine_pid(frontend_pid: int) -> int | None:
    import psutil

    for child in psutil.Process(frontend_pid).children():
        if "resource_tracker" not in " ".join(child.cmdline()):
            return int(child.pid)
    return None


async def stream_all(target: str, streams: int, tokens: int) -> tuple[int, int, float]:
    """``streams`` concurrent GenerateStream calls; (tokens, messages, wall seconds)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def one() -> tuple[int, int]:
            request = generate_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=PROMPT),
                stopping=generate_pb2.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
            )
            n_tok = n_msg = 0
            async for reply in stub.GenerateStream(request):
                if reply.HasField("delta"):
                    n_tok += len(reply.delta.token_ids)
                    n_msg += 1
            return n_tok, n_msg

        started = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(streams)))
        wall = time.perf_counter() - started
    return sum(c[0] for c in counts), sum(c[1] for c in counts), wall


def one_rep(target: str, pid: int, streams: int, tokens: int) -> dict[str, float]:
    """One run: the CPU per streamed token of ``pid`` and of its engine child."""
    child = engine_pid(pid)
    c0, e0 = cpu_seconds(pid), cpu_seconds(child) if child else 0.0
    n_tok, n_msg, wall = asyncio.run(stream_all(target, streams, tokens))
    c1, e1 = cpu_seconds(pid), cpu_seconds(child) if child else 0.0
    return {
        "token": (c1 - c0) / n_tok * 1e3,
        "message": (c1 - c0) / n_msg * 1e3,
        "engine": (e1 - e0) / n_tok * 1e3,
        "tokens_per_message": n_tok / n_msg,
        "wall": wall,
    }


def measure(servers: dict[str, tuple[str, int]], streams: int, tokens: int, reps: int) -> None:
    """Median CPU per streamed token of each server over ``reps`` runs, the servers
    taking turns (so that the machine's load falls on each alike)."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    load = os.getloadavg()[0]
    for _ in range(reps):
        for name, (target, pid) in servers.items():
            runs[name].append(one_rep(target, pid, streams, tokens))
    for name, rs in runs.items():
        row = {
            "streams": streams,
            "tokens": tokens,
            "cpu_ms_per_token": round(statistics.median(r["token"] for r in rs), 4),
            "cpu_ms_per_message": round(statistics.median(r["message"] for r in rs), 4),
            "tokens_per_message": round(statistics.median(r["tokens_per_message"] for r in rs), 2),
            "all_cpu_ms_per_token": [round(r["token"], 4) for r in rs],
            "engine_cpu_ms_per_token": round(statistics.median(r["engine"] for r in rs), 4),
            "wall_s": round(statistics.median(r["wall"] for r in rs), 3),
            "load": round(load, 2),
        }
        print(f"{name:9s}", row, flush=True)


# -- the bare servicer -------------------------------------------------------------------


class BareGenerate(generate_pb2_grpc.GenerateServiceServicer):
    """One Delta per token (text and one token id), then a Final: gRPC's cost alone.

    Paced at ``interval_s`` between tokens (about an engine step), so that each
    message is written on its own, as the frontend's are, rather than coalesced
    with the next ones in gRPC's write buffer."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    async def GenerateStream(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        n = request.stopping.max_new_tokens
        for i in range(n):
            if self.interval_s:
                await asyncio.sleep(self.interval_s)
            yield generate_pb2.GenerateStreamResponse(
                delta=generate_pb2.Delta(text=" tok", token_ids=[100 + i % 50])
            )
        yield generate_pb2.GenerateStreamResponse(
            final=generate_pb2.Final(
                token_ids=[100 + i % 50 for i in range(n)],
                finish_reason=common_pb2.FINISH_REASON_MAX_TOKENS,
            )
        )


async def serve_bare(port: int, interval_s: float) -> None:
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(BareGenerate(interval_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def start_bare(interval_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.frontend_profile",
            "--serve-bare",
            str(port),
            "--bare-interval-ms",
            str(interval_ms),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # "ready"
    return proc, f"127.0.0.1:{port}"


# -- profiling ---------------------------------------------------------------------------


def py_spy(target: str, pid: int, streams: int, tokens: int, out: Path) -> None:
    """Record the frontend under py-spy during one run; write its top functions to ``out``."""
    exe = Path(sys.executable).with_name("py-spy")
    raw = out.with_suffix(".raw.txt")
    spy = subprocess.Popen(
        [str(exe), "record", "--pid", str(pid), "--format", "raw", "--output", str(raw),
         "--rate", "200", "--threads", "--native"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(1.0)
    asyncio.run(stream_all(target, streams, tokens))
    spy.send_signal(2)
    spy.wait(timeout=30)
    out.write_text(summarise_raw(raw.read_text()))


# Where a busy sample of the frontend goes: the innermost frame that matches.
CATEGORIES = (
    ("pipe read + unpickle", ("_pickle", "Connection.recv", "Connection._recv", "_on_readable",
                              "connection.py", "PipeReader")),
    ("demux", ("_dispatch",)),
    ("queue hand-off + request stream", ("EngineProcess.generate", "queues.py", "merge_outputs",
                                         "dataclasses.py", "coalesce")),
    ("metrics", ("prometheus_client", "Frontend.outputs", "metrics.py")),
    ("protobuf construction", ("convert.py", "Frontend.events", "GenerateStream ",
                               "_event_fields")),
    ("rpc wrapper (auth, logging, error mapping)", ("stream_wrapper", "structlog", "servicers.py")),
    ("gRPC (cygrpc: write, completion queue)", ("cygrpc", "grpc/")),
    ("asyncio loop", ("asyncio/",)),
)  # fmt: skip
IDLE = ("epoll_wait", "pthread_cond", "futex", "sem_wait")


def categorise(frames: list[str]) -> str:
    if any(frames[-1].startswith(name) for name in IDLE):
        return "idle"
    for frame in reversed(frames):
        for name, patterns in CATEGORIES:
            if any(p in frame for p in patterns):
                return name
    return "other"


def summarise_raw(raw: str, top: int = 30) -> str:
    """The busy samples of each thread by category, then by function (py-spy's raw format)."""
    by_cat: dict[str, int] = {}
    self_n: dict[str, int] = {}
    busy = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        thread = "main" if "MainThread" in frames[0] else "other threads"
        cat = categorise(frames[1:])
        if cat == "idle":
            continue
        busy += n
        key = f"{thread}: {cat}"
        by_cat[key] = by_cat.get(key, 0) + n
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
    lines = [f"{busy} busy samples", "", "busy %  category"]
    for key, n in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"{100 * n / busy:5.1f}  {key}")
    lines += ["", "self %  function (busy samples)"]
    for f, n in sorted(self_n.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / busy:5.1f}  {f}")
    return "\n".join(lines) + "\n"


def tiny_model_dir() -> str:
    sys.path.insert(0, str(REPO))
    from tests.tiny_model import TinyModelSpec, build_tiny_model

    out = Path(tempfile.mkdtemp(prefix="frontend-profile-"))
    return str(build_tiny_model(out, TinyModelSpec(max_seq_len=4096)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="default, tiny (the test model) or a dir")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per stream")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--streams", default="1,8")
    p.add_argument("--stream-interval", type=int, default=None)
    p.add_argument("--no-bare", action="store_true")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run the server from this checkout (e.g. a worktree of main), taking turns",
    )
    p.add_argument("--py-spy", type=Path, default=None, metavar="OUT")
    p.add_argument(
        "--bare-interval-ms",
        type=float,
        default=8.0,
        help="the bare servicer's pause between tokens (0: as fast as it can)",
    )
    p.add_argument("--serve-bare", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_bare is not None:
        asyncio.run(serve_bare(args.serve_bare, args.bare_interval_ms / 1e3))
        return 0
    streams = [int(s) for s in args.streams.split(",")]
    model = args.model
    if model == "tiny":
        model = tiny_model_dir()
    elif model == "default":
        from genai_service.convert.default_model import resolve_model

        model = str(resolve_model("default"))
    extra = ["--max-new-tokens-limit", str(max(4096, args.tokens))]
    if args.stream_interval is not None:
        extra += ["--stream-interval", str(args.stream_interval)]
    servers = {"frontend": ServerProcess(model, threads=1, extra_args=extra)}
    if args.baseline is not None:
        # The same flags, the code of another checkout (PYTHONPATH goes before the venv's).
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(args.baseline.resolve())
        try:
            servers["baseline"] = ServerProcess(model, threads=1, extra_args=extra[:2])
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
    try:
        for server in servers.values():
            asyncio.run(stream_all(server.target, 2, 32))  # warm up
        targets = {name: (s.target, s.proc.pid) for name, s in servers.items()}
        for n in streams:
            measure(targets, n, args.tokens, args.reps)
        if args.py_spy is not None:
            server = servers["frontend"]
            py_spy(server.target, server.proc.pid, min(streams), args.tokens * 2, args.py_spy)
            print("py-spy profile:", args.py_spy)
    finally:
        for server in servers.values():
            server.stop()
    if not args.no_bare:
        proc, target = start_bare(args.bare_interval_ms)
        try:
            asyncio.run(stream_all(target, 2, 32))
            for n in streams:
                measure({"bare": (target, proc.pid)}, n, args.tokens, args.reps)
        finally:
            stop_tree(proc, timeout_s=5)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
