"""Request ids are scoped per principal: one tenant can neither block, detect nor cancel
another's requests by reusing their ids (docs/design.md, "Processes and planes")."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from genai_proto.genai.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from genai_service.config import CacheConfig, EngineConfig, ServerConfig
from tests.server_harness import ServerThread, free_port

pytestmark = pytest.mark.e2e

ALICE = (("authorization", "Bearer alice-token"),)
BOB = (("authorization", "Bearer bob-token"),)


@pytest.fixture(scope="module")
def server(long_context_model_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(long_context_model_dir), cache=CacheConfig(chunk_size=4)),
        port=free_port(),
        auth_tokens=(("alice-token", "alice"), ("bob-token", "bob")),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


@pytest.fixture()
def stub(server: ServerThread) -> Iterator[generate_pb2_grpc.GenerateServiceStub]:
    with server.channel() as ch:
        yield generate_pb2_grpc.GenerateServiceStub(ch)


def request(rid: str, n: int, text: str = "the cat") -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=rid,
        text=text,
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
    )


def test_the_same_id_from_two_principals_both_run(
    stub: generate_pb2_grpc.GenerateServiceStub,
) -> None:
    running = stub.GenerateStream(request("shared-id", 3000), metadata=ALICE, timeout=60)
    assert next(running).HasField("delta")
    # Bob's request with Alice's in-flight id runs, and answers with his id.
    r = stub.Generate(request("shared-id", 3), metadata=BOB, timeout=30)
    assert len(r.token_ids) == 3 and r.request_id == "shared-id"
    # The same id twice from one principal is still refused.
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request("shared-id", 3), metadata=ALICE, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "request_id: 'shared-id' is already in flight"
    running.cancel()


def test_a_bidi_cancel_reaches_only_the_callers_own_request(
    stub: generate_pb2_grpc.GenerateServiceStub,
) -> None:
    victim = stub.GenerateStream(request("victim-id", 1500), metadata=ALICE, timeout=60)
    assert next(victim).HasField("delta")
    # Bob starts a request under Alice's id and, once it streams, cancels that id.
    streaming, done = threading.Event(), threading.Event()

    def messages() -> Iterator[generate_pb2.BidiRequest]:
        yield generate_pb2.BidiRequest(start=request("victim-id", 3000))
        streaming.wait(30)
        yield generate_pb2.BidiRequest(cancel=generate_pb2.CancelRequest(request_id="victim-id"))
        done.wait(30)

    finals = []
    for event in stub.GenerateBidi(messages(), metadata=BOB, timeout=60):
        assert not event.HasField("error"), event.error.message
        streaming.set()
        if event.HasField("final"):
            finals.append(event.final)
            break
    done.set()
    assert [f.finish_reason for f in finals] == [common_pb2.FINISH_REASON_CANCELLED]
    # Alice's request was not touched: it runs to its length.
    rest = list(victim)
    assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
    assert len(rest[-1].final.token_ids) == 1500
