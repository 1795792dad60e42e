"""How long after a kvstore comes back do the engine connector's pushes land again?

The measurement behind the data plane's reconnect backoff (kvstore/protocol.py,
CHANNEL_OPTIONS; docs/design.md, "KV chunk contract"): a kvstore on a fixed
loopback port, a GrpcKvChunkStore pushing a new chunk every 0.2 s through an
outage of ``--outage-s``, then every 0.05 s until one lands.

    python -m bench.kv_reconnect --outage-s 30            # the project's options
    python -m bench.kv_reconnect --outage-s 30 --grpc-default
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import numpy as np

import kvstore.client as kvstore_client
from genai_service.engine.kv.kv_connector import GrpcKvChunkStore
from genai_service.engine.kv.kv_integrity import KvIntegrity
from kvstore.protocol import MAX_MESSAGE_BYTES
from kvstore.server import KvStoreConfig, RunningServer, start_server

from .procs import free_port

TOKEN = "kv-reconnect-bench-token"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage-s", type=float, default=6.0)
    parser.add_argument(
        "--grpc-default", action="store_true", help="gRPC's own reconnect backoff, for comparison"
    )
    args = parser.parse_args()
    if args.grpc_default:
        kvstore_client.CHANNEL_OPTIONS = (
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        )
    port = free_port()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def up() -> RunningServer:
        config = KvStoreConfig(host="127.0.0.1", port=port, grace_s=0.0, auth_token=TOKEN)
        return asyncio.run_coroutine_threadsafe(start_server(config), loop).result(10)

    server = up()
    store = GrpcKvChunkStore(
        f"127.0.0.1:{port}",
        dtype="float32",
        timeout_s=0.5,
        auth_token=TOKEN,
        integrity=KvIntegrity.generate(),
    )
    layers = [(np.ones((2, 4, 4), np.float32), np.ones((2, 4, 4), np.float32))]
    pushed = 0

    def push() -> None:
        nonlocal pushed
        pushed += 1
        store.push(pushed.to_bytes(8, "big"), layers)

    push()
    store.flush(5)
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    started = time.monotonic()
    while time.monotonic() - started < args.outage_s:
        push()
        time.sleep(0.2)
    server = up()
    back = time.monotonic()
    landed = store.stats()["pushed_chunks"]
    while store.stats()["pushed_chunks"] == landed and time.monotonic() - back < 120:
        push()
        time.sleep(0.05)
    resumed = time.monotonic() - back
    stats = store.stats()
    store.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    print(
        json.dumps(
            {
                "options": "grpc-default" if args.grpc_default else "project",
                "outage_s": args.outage_s,
                "resumed_after_s": round(resumed, 2),
                "push_errors": stats["errors"],
            }
        )
    )


if __name__ == "__main__":
    main()
