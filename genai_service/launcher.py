"""``genai-stack``: the pod on one machine (what ``make serve`` runs).

Starts ``genai-kvstore`` and ``genai-server`` (connected to it) as child
processes, both given one data-plane token through the environment (not argv,
which ``ps`` shows): ``$GENAI_KVSTORE_AUTH_TOKEN`` when set, else a fresh
random one, so nothing without it can read or write the pair's KV. The server
also gets a freshly generated KV integrity key (``--kv-integrity-key-file``: a
0600 file in a private temporary directory, removed at exit), unless given one
(to keep a disk tier's KV and sessions usable across runs). It waits until
the server reports SERVING, streams one sample chat answer through the public
client, then keeps serving until Ctrl-C/SIGTERM and stops both children
gracefully.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genai_service.config import ServerConfig
from kvstore.protocol import AUTH_TOKEN_ENV  # read by both children
from kvstore.server import KvStoreConfig

SAMPLE_PROMPT = "Name three primary colors."


def data_plane_token(environ: Mapping[str, str]) -> str:
    """The kvstore token both children get: the caller's, else a new random one."""
    return environ.get(AUTH_TOKEN_ENV) or secrets.token_urlsafe(32)


def wait_serving(target: str, timeout_s: float, procs: Sequence[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    name = proc.args[0] if isinstance(proc.args, list) else proc.args
                    raise RuntimeError(f"{name!s} exited with code {proc.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise TimeoutError(f"{target} did not report SERVING within {timeout_s:.0f} s")


def sample_request(target: str, prompt: str) -> None:
    from genai_client import Client

    with Client(target) as client:
        print(f"> {prompt}", flush=True)
        stream = client.stream(messages=[("user", prompt)], max_new_tokens=128)
        started = time.monotonic()
        for delta in stream:
            print(delta.text, end="", flush=True)
        result = stream.result
        elapsed = time.monotonic() - started
        print(
            f"\n[{result.usage.completion_tokens} tokens, {result.finish_reason}, "
            f"{result.usage.completion_tokens / max(elapsed, 1e-9):.1f} tok/s]",
            flush=True,
        )


def write_integrity_key(directory: str) -> str:
    """A new random KV integrity key in ``directory``, readable by this user only."""
    path = os.path.join(directory, "kv-integrity.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="genai-stack", description=__doc__)
    p.add_argument("--model", default="default")
    # Defaults are the servers' own (their config dataclasses), never restated.
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.add_argument("--kvstore-port", type=int, default=KvStoreConfig.port)
    p.add_argument(
        "--kvstore-memory-bytes",
        default=None,
        help="genai-kvstore --memory-bytes (default: genai-kvstore's own)",
    )
    p.add_argument("--kvstore-disk-dir", default=None)
    p.add_argument("--prompt", default=SAMPLE_PROMPT)
    p.add_argument("--once", action="store_true", help="exit after the sample request")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument(
        "--kv-integrity-key-file",
        default=None,
        metavar="PATH",
        help="the server's KV integrity key; pass one of your own to keep a --kvstore-disk-dir's "
        "KV and sessions usable across runs (default: a fresh key each run)",
    )
    args, server_args = p.parse_known_args(argv)

    bin_dir = os.path.dirname(sys.executable)
    kv_cmd = [
        os.path.join(bin_dir, "genai-kvstore"),
        "--host", args.host,
        "--port", str(args.kvstore_port),
    ]  # fmt: skip
    if args.kvstore_memory_bytes:
        kv_cmd += ["--memory-bytes", args.kvstore_memory_bytes]
    if args.kvstore_disk_dir:
        kv_cmd += ["--disk-dir", args.kvstore_disk_dir]
    key_dir = tempfile.mkdtemp(prefix="genai-stack-")  # mode 0700; removed at exit
    procs: list[subprocess.Popen[bytes]] = []
    target = f"{args.host}:{args.port}"
    stop_requested = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server_cmd = [
            os.path.join(bin_dir, "genai-server"),
            "--model", args.model,
            "--host", args.host,
            "--port", str(args.port),
            "--kvstore", f"{args.host}:{args.kvstore_port}",
            "--kv-integrity-key-file", args.kv_integrity_key_file or write_integrity_key(key_dir),
            *server_args,
        ]  # fmt: skip
        env = {**os.environ, AUTH_TOKEN_ENV: data_plane_token(os.environ)}
        procs.append(subprocess.Popen(kv_cmd, env=env))
        procs.append(subprocess.Popen(server_cmd, env=env))
        print(f"starting genai-kvstore and genai-server ({args.model}) ...", flush=True)
        wait_serving(target, args.start_timeout, procs)
        print(f"serving on {target} (kvstore on {args.host}:{args.kvstore_port})", flush=True)
        sample_request(target, args.prompt)
        if args.once:
            return 0
        print("Ctrl-C to stop.", flush=True)
        while not stop_requested and all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        return 0 if stop_requested else 1
    finally:
        stop_all(procs)
        shutil.rmtree(key_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
