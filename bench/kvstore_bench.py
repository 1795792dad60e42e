"""Get throughput of the kvstore over loopback, for chunk-sized KV blobs.

The default blob is one 256-token chunk of SmolLM2-135M in fp32:
30 layers x (K, V) x 3 kv heads x 256 tokens x 64 head_dim x 4 bytes = 11.8 MB
(plus the 40-byte payload header and trailer). The server runs in its own
process (``python -m kvstore``); the client measures whole-blob Gets, with and
without its checksum check, sequentially and with concurrent requests.

    .venv/bin/python bench/kvstore_bench.py [--gets 40] [--concurrency 4]

Prints one JSON object; makes no assertion on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from genai_service.engine.kv.kv_codec import pack_kv
from kvstore.checksum import checksum
from kvstore.client import AsyncKvStoreClient, KvStoreClient

REPO = Path(__file__).resolve().parent.parent
TOKEN = secrets.token_urlsafe(32)  # the data-plane token of the kvstore started here


def chunk_blob(layers: int, kv_heads: int, tokens: int, head_dim: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    shape = (kv_heads, tokens, head_dim)  # [kv_heads, num_tokens, head_dim]
    kv = [
        (rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
        for _ in range(layers)
    ]
    return pack_kv(kv, np.float32)


def start_server(memory_bytes: int) -> tuple[subprocess.Popen[str], int]:
    """Run ``python -m kvstore --port 0`` and read the bound port from its JSON log."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "--port", "0", "--memory-bytes", str(memory_bytes)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "GENAI_KVSTORE_AUTH_TOKEN": TOKEN},
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        event = json.loads(line)
        if event.get("event") == "kvstore serving":
            return proc, int(event["port"])
    proc.kill()
    raise RuntimeError("kvstore server did not start")


def sync_gets(target: str, keys: list[bytes], gets: int, verify: bool) -> float:
    with KvStoreClient(target, auth_token=TOKEN, timeout_s=60, verify=verify) as client:
        client.get(keys[0])  # warm the connection
        start = time.perf_counter()
        total = 0
        for i in range(gets):
            blob = client.get(keys[i % len(keys)])
            assert blob is not None
            total += len(blob)
        return total / (time.perf_counter() - start) / 1e9


async def async_gets(target: str, keys: list[bytes], gets: int, concurrency: int) -> float:
    async with AsyncKvStoreClient(target, auth_token=TOKEN, timeout_s=60) as client:
        await client.get(keys[0])
        queue = list(range(gets))
        total = 0

        async def worker() -> None:
            nonlocal total
            while queue:
                blob = await client.get(keys[queue.pop() % len(keys)])
                assert blob is not None
                total += len(blob)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - start) / 1e9


def measure(
    layers: int = 30,
    kv_heads: int = 3,
    tokens: int = 256,
    head_dim: int = 64,
    n_blobs: int = 4,
    gets: int = 40,
    concurrency: int = 4,
) -> dict:
    """Put/Get throughput in GB/s for chunk-sized blobs over loopback."""
    blobs = [chunk_blob(layers, kv_heads, tokens, head_dim, seed) for seed in range(n_blobs)]
    keys = [checksum(blob) for blob in blobs]
    proc, port = start_server(memory_bytes=2 * sum(map(len, blobs)))
    target = f"127.0.0.1:{port}"
    try:
        with KvStoreClient(target, auth_token=TOKEN, timeout_s=60) as client:
            client.wait_ready(30)
            start = time.perf_counter()
            for key, blob in zip(keys, blobs, strict=True):
                client.put(key, blob)
            put_gbps = sum(map(len, blobs)) / (time.perf_counter() - start) / 1e9
        return {
            "blob_bytes": len(blobs[0]),
            "gets": gets,
            "cpu_count": os.cpu_count(),
            "put_gb_per_s": round(put_gbps, 3),
            "get_gb_per_s_sync": round(sync_gets(target, keys, gets, True), 3),
            "get_gb_per_s_sync_no_verify": round(sync_gets(target, keys, gets, False), 3),
            f"get_gb_per_s_async_x{concurrency}": round(
                asyncio.run(async_gets(target, keys, gets, concurrency)), 3
            ),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--blobs", type=int, default=4, help="distinct blobs stored")
    parser.add_argument("--gets", type=int, default=40, help="Gets per measurement")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    result = measure(
        args.layers,
        args.kv_heads,
        args.tokens,
        args.head_dim,
        args.blobs,
        args.gets,
        args.concurrency,
    )
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
