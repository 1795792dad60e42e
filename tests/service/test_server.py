"""The gRPC service against a real server (engine in its own process) on the tiny model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, json_format
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from genai_client.errors import FieldViolation, from_rpc_error
from genai_proto.genai.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    model_pb2,
    model_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from genai_service.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import encode_words

pytestmark = pytest.mark.e2e


def engine_config(model_dir: Path, **kw) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir),
        cache=kw.pop("cache", CacheConfig(chunk_size=4)),
        scheduler=kw.pop("scheduler", SchedulerConfig(max_num_seqs=4, max_queue=4)),
        **kw,
    )


@pytest.fixture(scope="module")
def server(long_context_model_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(
        ServerConfig(engine=engine_config(long_context_model_dir), port=free_port())
    ).start()
    yield srv
    srv.stop()


@pytest.fixture()
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


def gen_request(text: str, n: int = 8, **kw) -> generate_pb2.GenerateRequest:
    stopping = kw.pop("stopping", {})
    return generate_pb2.GenerateRequest(
        text=text,
        stopping=generate_pb2.StoppingCriteria(max_new_tokens=n, ignore_eos=True, **stopping),
        **kw,
    )


def code_of(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = fn(*args, **kw)
        if hasattr(result, "__iter__") and not isinstance(result, generate_pb2.GenerateResponse):
            list(result)
    return err.value.code(), err.value.details()


def test_reflection_and_health(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"genai.v1.GenerateService", "genai.v1.SessionService", "genai.v1.ModelService"} <= names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= (
        names
    )
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "genai.v1.GenerateService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_v1(channel: grpc.Channel) -> None:
    # A raw grpc.reflection.v1 call (its messages are v1alpha's on the wire).
    info = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="genai.v1.GenerateService"),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"
        ),
    ]
    listed, generate, v1 = list(info(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"genai.v1.GenerateService", "grpc.reflection.v1.ServerReflection"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in generate.file_descriptor_response.file_descriptor_proto
    ]
    assert "genai/v1/generate.proto" in {f.name for f in files}
    (v1_file,) = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in v1.file_descriptor_response.file_descriptor_proto
    ]
    assert v1_file.package == "grpc.reflection.v1"
    assert v1_file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def test_generate_rpcs_match_the_in_process_engine(
    channel: grpc.Channel, long_context_model_dir: Path
) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    engine = LLMEngine(engine_config(long_context_model_dir))
    prompt = "the cat sat on the mat"
    want = engine.generate(
        GenerationRequest(
            "x",
            tuple(encode_words(prompt)),
            stopping=StoppingCriteria(max_new_tokens=8, ignore_eos=True),
        )
    )
    unary = stub.Generate(gen_request(prompt))
    assert list(unary.token_ids) == list(want.token_ids)
    assert unary.text == want.text
    assert unary.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
    assert unary.usage.prompt_tokens == 6 and unary.usage.completion_tokens == 8
    events = list(stub.GenerateStream(gen_request(prompt)))
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    assert "".join(d.text for d in deltas) == unary.text
    assert [t for d in deltas for t in d.token_ids] == list(unary.token_ids)
    final = events[-1].final
    assert events[-1].WhichOneof("event") == "final"
    assert final.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
    assert list(final.token_ids) == list(unary.token_ids)
    assert final.usage.completion_tokens == 8
    bidi = list(
        stub.GenerateBidi(
            iter([generate_pb2.BidiRequest(start=gen_request(prompt, request_id="b1"))])
        )
    )
    assert [t for e in bidi if e.WhichOneof("event") == "delta" for t in e.delta.token_ids] == list(
        unary.token_ids
    )
    assert bidi[-1].final.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS


def test_bidi_two_requests_one_cancelled(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    cancel_sent = threading.Event()
    first_delta = threading.Event()

    def requests() -> Iterator[generate_pb2.BidiRequest]:
        # 4,000 tokens: long enough that the cancel always lands first (100 did not on a
        # fast CI machine: the tiny model finished before the cancel was read).
        yield generate_pb2.BidiRequest(start=gen_request("the cat", 4000, request_id="long"))
        yield generate_pb2.BidiRequest(start=gen_request("the dog", 10, request_id="short"))
        first_delta.wait(30)
        yield generate_pb2.BidiRequest(cancel=generate_pb2.CancelRequest(request_id="long"))
        cancel_sent.set()

    finals = {}
    tokens: dict[str, int] = {"long": 0, "short": 0}
    for event in stub.GenerateBidi(requests(), timeout=60):
        kind = event.WhichOneof("event")
        if kind == "delta":
            tokens[event.request_id] += len(event.delta.token_ids)
            first_delta.set()
        elif kind == "final":
            finals[event.request_id] = event.final
    assert finals["short"].finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
    assert tokens["short"] == 10
    assert finals["long"].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert tokens["long"] < 4000


def test_bidi_errors_are_per_request(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    bad = gen_request("hello", 4, request_id="bad", sampling=generate_pb2.SamplingParams(top_p=2.0))
    good = gen_request("hello", 4, request_id="good")
    events = list(
        stub.GenerateBidi(
            iter([generate_pb2.BidiRequest(start=bad), generate_pb2.BidiRequest(start=good)])
        )
    )
    errors = [e for e in events if e.WhichOneof("event") == "error"]
    assert [(e.request_id, e.error.code) for e in errors] == [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])
    ]
    assert "sampling.top_p: 2.0 is out of range" in errors[0].error.message
    # A google.rpc.Status: the BadRequest names the field as data.
    (detail,) = errors[0].error.details
    bad_request = error_details_pb2.BadRequest()
    assert detail.Unpack(bad_request)
    (violation,) = bad_request.field_violations
    assert violation.field == "sampling.top_p"
    assert violation.description.startswith("2.0 is out of range")
    assert any(e.request_id == "good" and e.WhichOneof("event") == "final" for e in events)


def test_a_failed_call_carries_its_google_rpc_status(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    bad = gen_request("hello", 4, sampling=generate_pb2.SamplingParams(temperature=-1.0))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(bad, timeout=30)
    status = rpc_status.from_call(err.value)  # also checks code and message agree
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert [v.field for v in bad_request.field_violations] == ["sampling.temperature"]
    # The typed client error reads it.
    assert from_rpc_error(err.value).field_violations == (
        FieldViolation("sampling.temperature", bad_request.field_violations[0].description),
    )


def test_sessions_over_rpc(channel: grpc.Channel) -> None:
    sessions = session_pb2_grpc.SessionServiceStub(channel)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    sid = sessions.CreateSession(
        session_pb2.CreateSessionRequest(metadata={"user": "ada"})
    ).session.session_id
    t1 = stub.Generate(gen_request("hello , who are you ?", 6, session_id=sid))
    t2 = stub.Generate(gen_request("what is your name ?", 6, session_id=sid))
    assert t2.usage.cached_tokens >= t1.usage.prompt_tokens + t1.usage.completion_tokens
    info = sessions.GetSession(session_pb2.GetSessionRequest(session_id=sid)).session
    assert (
        info.turns == 2
        and info.history_tokens == t2.session_tokens
        and info.metadata["user"] == "ada"
    )
    listed = sessions.ListSessions(session_pb2.ListSessionsRequest()).sessions
    assert sid in {s.session_id for s in listed}
    reset = sessions.ResetSession(session_pb2.ResetSessionRequest(session_id=sid)).session
    assert reset.history_tokens == 0
    t3 = stub.Generate(gen_request("hello", 2, session_id=sid))
    assert t3.usage.cached_tokens == 0 and t3.session_tokens == 3
    # a second turn while one runs
    stream = stub.GenerateStream(gen_request("the cat", 3000, session_id=sid))
    next(stream)
    code, msg = code_of(stub.Generate, gen_request("the dog", 2, session_id=sid))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already running a turn" in msg
    stream.cancel()
    sessions.CloseSession(session_pb2.CloseSessionRequest(session_id=sid))
    for call in (
        lambda: sessions.GetSession(session_pb2.GetSessionRequest(session_id=sid)),
        lambda: stub.Generate(gen_request("hello", 2, session_id=sid)),
        lambda: sessions.GetSession(session_pb2.GetSessionRequest(session_id="not-a-session")),
    ):
        code, _ = code_of(call)
        assert code == grpc.StatusCode.NOT_FOUND


def test_a_session_turns_prompt_tokens_count_the_history(channel: grpc.Channel) -> None:
    # Usage.prompt_tokens (common.proto): history plus this turn's new input.
    sessions = session_pb2_grpc.SessionServiceStub(channel)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    models = model_pb2_grpc.ModelServiceStub(channel)
    sid = sessions.CreateSession(session_pb2.CreateSessionRequest()).session.session_id
    t1 = stub.Generate(gen_request("the cat sat", 4, session_id=sid))
    t2 = stub.Generate(gen_request("on the mat", 4, session_id=sid, add_special_tokens=False))
    new = models.Tokenize(model_pb2.TokenizeRequest(text="on the mat", add_special_tokens=False))
    assert t1.usage.prompt_tokens == t1.session_tokens - 4
    assert t2.usage.prompt_tokens == t1.session_tokens + len(new.token_ids)
    assert t2.session_tokens == t2.usage.prompt_tokens + 4
    sessions.CloseSession(session_pb2.CloseSessionRequest(session_id=sid))


def test_a_stop_token_id_is_reported_as_its_text(channel: grpc.Channel) -> None:
    # GenerateResponse.stop_sequence (generate.proto): the stop token's own text.
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    models = model_pb2_grpc.ModelServiceStub(channel)
    free = stub.Generate(gen_request("the cat sat on the mat", 6))
    stop_id = free.token_ids[2]
    stop_text = models.Detokenize(
        model_pb2.DetokenizeRequest(token_ids=[stop_id], skip_special_tokens=False)
    ).text
    assert stop_text
    want_ids = list(free.token_ids[: list(free.token_ids).index(stop_id) + 1])
    request = gen_request("the cat sat on the mat", 6, stopping=dict(stop_token_ids=[stop_id]))
    unary = stub.Generate(request)
    final = list(stub.GenerateStream(request))[-1].final
    for result in (unary, final):
        assert result.finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE
        assert result.stop_sequence == stop_text
        assert list(result.token_ids) == want_ids


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            gen_request("hello", sampling=generate_pb2.SamplingParams(temperature=-1)),
            "sampling.temperature: -1.0 is out of range",
        ),
        (
            gen_request("hello", sampling=generate_pb2.SamplingParams(top_p=0)),
            "sampling.top_p: 0.0 is out of range",
        ),
        (
            gen_request("hello", stopping=dict(min_new_tokens=20)),
            "stopping.min_new_tokens: 20 is out of range; allowed [0, 8]",
        ),
        (generate_pb2.GenerateRequest(), "input: is empty"),
        (generate_pb2.GenerateRequest(text=""), "input: is empty"),
        (
            generate_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1, 9999])),
            "token_ids[1]: 9999 is out of range",
        ),
        (gen_request(" ".join(["the"] * 4096)), "the context window is 4096 tokens"),
        (gen_request("hello", priority=7), "priority: 7 is not a known value"),
        (generate_pb2.GenerateRequest(messages=common_pb2.Messages()), "messages: is empty"),
    ],
)
def test_invalid_arguments(
    channel: grpc.Channel, request_: generate_pb2.GenerateRequest, message: str
) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    for call in (stub.Generate, stub.GenerateStream):
        code, details = code_of(call, request_)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in details


def test_chat_messages_use_the_template(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    models = model_pb2_grpc.ModelServiceStub(channel)
    messages = common_pb2.Messages(messages=[common_pb2.ChatMessage(role="user", content="hello")])
    tok = models.Tokenize(model_pb2.TokenizeRequest(messages=messages))
    assert tok.prompt_text == "<s> user : hello </s> <s> assistant : "
    r = stub.Generate(
        generate_pb2.GenerateRequest(
            messages=messages, stopping=generate_pb2.StoppingCriteria(max_new_tokens=3)
        )
    )
    assert r.usage.prompt_tokens == len(tok.token_ids)


def test_model_info_tokenize_detokenize(channel: grpc.Channel) -> None:
    models = model_pb2_grpc.ModelServiceStub(channel)
    info = models.GetModelInfo(model_pb2.GetModelInfoRequest()).model_info
    assert info.context_length == 4096 and info.vocab_size > 50 and list(info.eos_token_ids) == [2]
    assert info.kv_layout.num_layers == 2 and info.runner_kind == model_pb2.RUNNER_KIND_PAST_PRESENT
    assert info.has_chat_template and info.kv_chunk_size == 4
    tok = models.Tokenize(model_pb2.TokenizeRequest(text="the cat", return_tokens=True))
    assert list(tok.token_ids) == encode_words("the cat")
    assert [(t.text, t.char_start, t.char_end) for t in tok.tokens] == [
        ("the", 0, 3),
        ("cat", 4, 7),
    ]
    text = models.Detokenize(model_pb2.DetokenizeRequest(token_ids=tok.token_ids)).text
    assert text == "the cat"
    code, msg = code_of(models.Detokenize, model_pb2.DetokenizeRequest(token_ids=[10**6]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in msg


def engine_stats(server: ServerThread) -> dict:
    assert server.server is not None
    return server.run(server.server.engine.stats())


def test_client_cancel_and_deadline_abort_the_engine_request(
    server: ServerThread, channel: grpc.Channel
) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    before = engine_stats(server).get("requests_aborted", 0)
    stream = stub.GenerateStream(gen_request("the cat", 4000, stopping=dict()))
    next(stream)
    stream.cancel()
    code, _ = code_of(stub.Generate, gen_request("the cat", 4000), timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    code, _ = code_of(stub.GenerateStream, gen_request("the cat", 4000), timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        stats = engine_stats(server)
        if stats.get("requests_aborted", 0) - before >= 3 and stats["running"] == 0:
            break
        time.sleep(0.05)
    assert stats.get("requests_aborted", 0) - before == 3
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_queue_full_is_resource_exhausted(long_context_model_dir: Path) -> None:
    config = ServerConfig(
        engine=engine_config(
            long_context_model_dir, scheduler=SchedulerConfig(max_num_seqs=1, max_queue=1)
        ),
        port=free_port(),
    )
    srv = ServerThread(config).start()
    try:
        with srv.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            running = stub.GenerateStream(gen_request("the cat", 4000))
            next(running)
            waiting = stub.GenerateStream(gen_request("the dog", 4000))
            time.sleep(0.2)
            code, msg = code_of(stub.Generate, gen_request("hello", 2))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in msg
            running.cancel()
            waiting.cancel()
    finally:
        srv.stop()


def test_engine_death_mid_stream_is_unavailable_then_recovers(long_context_model_dir: Path) -> None:
    srv = ServerThread(
        ServerConfig(engine=engine_config(long_context_model_dir), port=free_port())
    ).start()
    try:
        with srv.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            stream = stub.GenerateStream(gen_request("the cat", 4000))
            next(stream)
            assert srv.server is not None
            old_pid = srv.server.engine.pid
            srv.server.engine.kill()
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine process exited" in err.value.details()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest()).status
                if status == health_pb2.HealthCheckResponse.SERVING and srv.server.engine.ready:
                    break
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert srv.server.engine.pid != old_pid
            r = stub.Generate(gen_request("hello", 3))
            assert len(r.token_ids) == 3
    finally:
        srv.stop()


def test_graceful_shutdown_lets_streams_finish(long_context_model_dir: Path) -> None:
    srv = ServerThread(
        ServerConfig(engine=engine_config(long_context_model_dir), port=free_port())
    ).start()
    with srv.channel() as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stream = stub.GenerateStream(gen_request("the cat", 4000))
        next(stream)
        assert srv.server is not None
        import asyncio

        stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(30), srv.loop)
        # draining: probes see NOT_SERVING (not a closed port) while the stream
        # runs, and new RPCs are refused
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, _ = code_of(stub.Generate, gen_request("hello", 2), timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert not stopping.done()
        rest = list(stream)
        assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
        stopping.result(30)
        watch.cancel()
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    srv.thread.join(10)


def test_a_stream_cut_at_the_grace_period_ends_unavailable_saying_so(
    long_context_model_dir: Path,
) -> None:
    """Issue 31: a stream still running when the grace period ends was cut
    with no final message (CANCELLED by gRPC's stop); it ends UNAVAILABLE,
    after the tokens it streamed, with a message a client can act on."""
    srv = ServerThread(
        ServerConfig(engine=engine_config(long_context_model_dir), port=free_port())
    ).start()
    with srv.channel() as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        stream = stub.GenerateStream(gen_request("the cat", 4000), timeout=60)
        tokens = len(next(stream).delta.token_ids)
        assert srv.server is not None
        import asyncio

        stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(0), srv.loop)
        with pytest.raises(grpc.RpcError) as err:
            for event in stream:
                assert event.WhichOneof("event") == "delta"
                tokens += len(event.delta.token_ids)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "grace period (0 s, --grace-period-s) ended" in err.value.details()
        assert 0 < tokens < 4000
        stopping.result(30)
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    srv.thread.join(10)


def test_json_form_of_the_final_response(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    r = stub.Generate(gen_request("hello", 3, request_id="fixed-id"))
    parsed = json_format.Parse(json_format.MessageToJson(r), generate_pb2.GenerateResponse())
    assert parsed == r and parsed.request_id == "fixed-id"


def test_sigterm_drains_and_exits_zero(long_context_model_dir: Path, tmp_path: Path) -> None:
    """The real `genai-server` command: SIGTERM mid-stream; while the stream completes,
    health answers NOT_SERVING and new requests UNAVAILABLE; exit 0."""
    import signal
    import subprocess
    import sys

    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "genai_service",
                "--model",
                str(long_context_model_dir),
                "--port",
                str(port),
                "--log-format",
                "json",
                "--grace-period",
                "20",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if (
                        health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            with pytest.raises(grpc.RpcError):
                stub.Generate(
                    gen_request(
                        "hello",
                        2,
                        request_id="bad-request-7",
                        sampling=generate_pb2.SamplingParams(top_p=5),
                    )
                )
            stream = stub.GenerateStream(gen_request("the cat", 4000))
            next(stream)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status != health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.01)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            code, details = code_of(stub.Generate, gen_request("hello", 2), timeout=5)
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
            assert proc.poll() is None
            rest = list(stream)
            assert rest[-1].final.finish_reason == common_pb2.FINISH_REASON_MAX_TOKENS
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    import json

    records = [
        json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")
    ]
    events = [r["event"] for r in records]
    assert "draining" in events and "stopped" in events
    # one structured line per failed RPC, carrying its request id and status code
    errors = [r for r in records if r["event"] == "rpc_error"]
    assert any(
        r["request_id"] == "bad-request-7" and r["code"] == "INVALID_ARGUMENT" for r in errors
    )


def test_session_chat_turns_continue_the_conversation(channel: grpc.Channel) -> None:
    sessions = session_pb2_grpc.SessionServiceStub(channel)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    models = model_pb2_grpc.ModelServiceStub(channel)
    sid = sessions.CreateSession(session_pb2.CreateSessionRequest()).session.session_id

    def turn(content: str) -> generate_pb2.GenerateResponse:
        msgs = common_pb2.Messages(messages=[common_pb2.ChatMessage(role="user", content=content)])
        return stub.Generate(
            generate_pb2.GenerateRequest(
                messages=msgs,
                session_id=sid,
                stopping=generate_pb2.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
            )
        )

    t1 = turn("hello")
    t2 = turn("who are you ?")
    # turn 2's new tokens: the close of turn 1 and the new user message, no restart
    added = t2.usage.prompt_tokens - t2.usage.cached_tokens
    want = models.Tokenize(
        model_pb2.TokenizeRequest(
            text="</s> <s> user : who are you ? </s> <s> assistant :", add_special_tokens=False
        )
    )
    assert added == len(want.token_ids)
    assert t2.usage.cached_tokens == t1.session_tokens


def test_closing_a_session_cancels_its_running_turn(channel: grpc.Channel) -> None:
    sessions = session_pb2_grpc.SessionServiceStub(channel)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    sid = sessions.CreateSession(session_pb2.CreateSessionRequest()).session.session_id
    stream = stub.GenerateStream(gen_request("the cat", 3000, session_id=sid))
    next(stream)
    sessions.CloseSession(session_pb2.CloseSessionRequest(session_id=sid))
    events = list(stream)
    assert events[-1].final.finish_reason == common_pb2.FINISH_REASON_CANCELLED


def test_cli_generate_json_matches_the_rpc(
    server: ServerThread, channel: grpc.Channel, capsys: pytest.CaptureFixture[str]
) -> None:
    from genai_client.cli import main as cli

    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    rc = cli(
        [
            "--target",
            server.target,
            "generate",
            "the cat sat",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ]
    )
    assert rc == 0
    printed = json_format.Parse(capsys.readouterr().out, generate_pb2.GenerateResponse())
    want = stub.Generate(gen_request("the cat sat", 6))
    assert printed.request_id and printed.seed
    for field in ("text", "token_ids", "finish_reason", "usage"):
        assert getattr(printed, field) == getattr(want, field), field
    # streamed text without --json, and exit code 1 with the status on stderr
    assert (
        cli(
            [
                "--target",
                server.target,
                "generate",
                "the cat sat",
                "--max-new-tokens",
                "6",
                "--ignore-eos",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.rstrip("\n") == want.text
    assert cli(["--target", server.target, "generate", "hello", "--temperature", "-1"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_client_library_against_the_server(server: ServerThread) -> None:
    from genai_client import Client, FailedPreconditionError, InvalidArgumentError, NotFoundError

    with Client(server.target) as client:
        result = client.generate("the cat sat", max_new_tokens=5, ignore_eos=True)
        stream = client.stream("the cat sat", max_new_tokens=5, ignore_eos=True)
        assert "".join(d.text for d in stream) == result.text == stream.result.text
        assert result.finish_reason == "MAX_TOKENS" and result.usage.completion_tokens == 5
        with client.session() as s:
            first = s.generate("hello , who are you ?", max_new_tokens=4, ignore_eos=True)
            second = s.generate("what is my name ?", max_new_tokens=4, ignore_eos=True)
            assert second.usage.cached_tokens == first.session_tokens
            running = s.stream("the cat", max_new_tokens=2000, ignore_eos=True)
            next(iter(running))
            with pytest.raises(FailedPreconditionError):
                s.generate("again", max_new_tokens=2)
            running.cancel()
        with pytest.raises(NotFoundError):
            client.get_session(s.id)
        with pytest.raises(InvalidArgumentError, match="sampling.top_k"):
            client.generate("hello", top_k=10**6)


def test_prometheus_metrics(long_context_model_dir: Path) -> None:
    import urllib.request

    srv = ServerThread(
        ServerConfig(engine=engine_config(long_context_model_dir), port=free_port(), metrics_port=0)
    ).start()
    try:
        with srv.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            stub.Generate(gen_request("the cat", 5))
            with pytest.raises(grpc.RpcError):
                stub.Generate(
                    gen_request("the cat", 5, sampling=generate_pb2.SamplingParams(top_k=10**6))
                )
        assert srv.server is not None and srv.server.metrics_port
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
        deadline = time.monotonic() + 10
        while True:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            if "genai_engine_requests_finished" in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        lines = [line for line in text.splitlines() if line.startswith("genai_rpc_requests_total")]
        assert 'genai_rpc_requests_total{code="OK",rpc="Generate"} 1.0' in lines, lines
        assert 'genai_rpc_requests_total{code="INVALID_ARGUMENT",rpc="Generate"} 1.0' in lines, (
            lines
        )
        assert "genai_completion_tokens_total 5.0" in text
        assert "genai_time_to_first_token_seconds_count 1.0" in text
        assert "genai_engine_ready 1.0" in text
        assert "genai_engine_requests_finished" in text
    finally:
        srv.stop()


def test_engine_that_keeps_failing_to_start_is_fatal(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backoff between restarts, then give up so the process exits non-zero."""
    import shutil

    from genai_service.server import engine_process

    monkeypatch.setattr(engine_process, "RESTART_BACKOFF_S", 0.01)
    monkeypatch.setattr(engine_process, "MAX_START_FAILURES", 2)
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    srv = ServerThread(ServerConfig(engine=engine_config(model), port=free_port())).start()
    try:
        assert srv.server is not None
        (model / "model.onnx").write_bytes(b"not an onnx graph")  # the next start fails
        srv.server.engine.kill()
        deadline = time.monotonic() + 60
        while not srv.server.fatal.done() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.server.fatal.done()
        assert "failed to start 2 times" in srv.server.fatal.result()
        assert srv.server.engine.restarts == 2
    finally:
        srv.stop()


def test_a_request_id_already_in_flight_is_invalid_argument(channel: grpc.Channel) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    running = stub.GenerateStream(gen_request("the cat", 3000, request_id="same-id"))
    next(running)
    code, msg = code_of(stub.Generate, gen_request("hello", 2, request_id="same-id"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg == "request_id: 'same-id' is already in flight"
    running.cancel()


def test_steps_a_stalled_frontend_missed_arrive_as_one_delta(
    server: ServerThread, channel: grpc.Channel
) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    n = 200
    unary = stub.Generate(gen_request("the cat sat on the mat", n))
    events = stub.GenerateStream(gen_request("the cat sat on the mat", n))
    first = next(events)
    # Stall the server's event loop while the engine keeps stepping: the
    # outputs it sends meanwhile wait in the request's queue.
    server.loop.call_soon_threadsafe(time.sleep, 1.0)
    rest = list(events)
    deltas = [e.delta for e in [first, *rest] if e.WhichOneof("event") == "delta"]
    assert [t for d in deltas for t in d.token_ids] == list(unary.token_ids)
    assert "".join(d.text for d in deltas) == unary.text
    assert len(deltas) < n  # without merging: one delta per step, n of them
    assert max(len(d.token_ids) for d in deltas) > 1
    assert rest[-1].final.usage.completion_tokens == n


def test_stream_interval_coalesces_up_to_n_tokens_per_delta(
    server: ServerThread, channel: grpc.Channel, long_context_model_dir: Path
) -> None:
    """``--stream-interval 4``: the same tokens, text and logprobs as one step per
    delta, the first token at once, no delta over 4 tokens (a stalled consumer
    catching up included), stop-sequence hold-back as before."""
    prompt, n = "the cat sat on the mat", 40
    ref_stub = generate_pb2_grpc.GenerateServiceStub(channel)
    plain = ref_stub.Generate(gen_request(prompt, n))
    stop = plain.text.split()[len(plain.text.split()) // 2]  # a word from the middle
    requests = [
        gen_request(prompt, n, top_logprobs=2),
        gen_request(prompt, n, stopping={"stop_sequences": [stop]}),
    ]
    coalescing = ServerThread(
        ServerConfig(
            engine=engine_config(long_context_model_dir), port=free_port(), stream_interval=4
        )
    ).start()
    try:
        with coalescing.channel() as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            for i, request in enumerate(requests):
                want = list(ref_stub.GenerateStream(request))
                events = stub.GenerateStream(request)
                got = [next(events)]
                if i == 0:  # the engine runs ahead while the frontend stalls
                    coalescing.loop.call_soon_threadsafe(time.sleep, 0.3)
                got += list(events)
                deltas = [e.delta for e in got if e.WhichOneof("event") == "delta"]
                ref = [e.delta for e in want if e.WhichOneof("event") == "delta"]
                assert len(deltas[0].token_ids) == 1
                assert max(len(d.token_ids) for d in deltas) <= 4
                for field in ("token_ids", "logprobs"):
                    assert [x for d in deltas for x in getattr(d, field)] == [
                        x for d in ref for x in getattr(d, field)
                    ]
                assert "".join(d.text for d in deltas) == "".join(d.text for d in ref)
                for field in ("token_ids", "logprobs", "finish_reason", "stop_sequence"):
                    assert getattr(got[-1].final, field) == getattr(want[-1].final, field)
            assert requests[1].stopping.stop_sequences[0] not in "".join(d.text for d in deltas)
            bidi = list(
                stub.GenerateBidi(
                    iter([generate_pb2.BidiRequest(start=gen_request(prompt, n, request_id="b"))])
                )
            )
            tokens = [list(e.delta.token_ids) for e in bidi if e.WhichOneof("event") == "delta"]
            assert [t for ts in tokens for t in ts] == list(plain.token_ids)
            assert len(tokens[0]) == 1 and max(map(len, tokens)) <= 4
    finally:
        coalescing.stop()
