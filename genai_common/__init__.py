"""What both servers and the client share, and nothing else (docs/design.md, Processes).

- ``errors``: the domain errors, one class per gRPC status code
- ``status``: an error's ``grpc.StatusCode`` (the servers' one mapping)
- ``decoding``: ``TolerantDecoding``, undecodable requests answered INVALID_ARGUMENT
- ``credentials``: TLS credentials and secrets read from files
- ``logging``: the structlog set-up each entry point does once

``genai_service`` (frontend and engine), ``kvstore`` and ``genai_client`` may
import it; it imports none of them, only grpc, protobuf and structlog.
"""
