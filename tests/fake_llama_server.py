"""A stand-in for llama.cpp's ``llama-server`` (tests of ``bench.llama``): the
flags the benchmark passes, ``GET /health`` and a streamed ``POST /completion``
that returns ``n_predict`` one-token events (token id = position) and the
final event with ``timings``, as llama-server does."""

from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass

    def do_GET(self) -> None:
        body = b'{"status":"ok"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = int(request["n_predict"])
        for i in range(n):
            time.sleep(0.002)
            event = {"content": "x", "tokens": [i], "stop": False}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        final = {"content": "", "stop": True, "timings": {"predicted_n": n}}
        self.wfile.write(f"data: {json.dumps(final)}\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("-m", "-t", "-tb", "-np", "-c", "--host"):
        p.add_argument(flag)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
