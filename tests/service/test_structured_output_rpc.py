"""GenerateRequest.constraint over gRPC (a real server on the tiny "bytes" model):
the client options, the CLI flags, streaming and the errors' field violations."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest

from genai_client import Client, InvalidArgumentError
from genai_client.cli import main as cli_main
from genai_proto.genai.v1 import generate_pb2, generate_pb2_grpc
from genai_service.config import EngineConfig, ServerConfig
from tests.server_harness import ServerThread, free_port

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(scope="module")
def server(bytes_models: dict[str, Path]) -> Iterator[ServerThread]:
    srv = ServerThread(
        ServerConfig(engine=EngineConfig(model_dir=str(bytes_models["rope"])), port=free_port())
    ).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c


def test_the_client_options_reach_the_engine(client: Client) -> None:
    result = client.generate("JSON: ", json_schema=SCHEMA, max_new_tokens=60)
    assert result.finish_reason == "EOS_TOKEN"
    value = json.loads(result.text)
    jsonschema.validate(value, SCHEMA)
    streamed = "".join(d.text for d in client.stream("JSON: ", json_schema=SCHEMA))
    assert streamed == result.text  # greedy: the same answer streamed
    assert client.generate("Pick: ", choice=["left", "right"]).text in ("left", "right")
    assert re.fullmatch(r"\d{3}", client.generate("Num: ", regex=r"\d{3}").text)
    assert client.generate("Yes? ", grammar='root ::= "yes" | "no"').text in ("yes", "no")
    # Any object (the tiny model's may run long: then it is cut short).
    obj = client.generate("Obj: ", json_object=True, max_new_tokens=40)
    assert obj.text.startswith("{")
    assert obj.finish_reason == "MAX_TOKENS" or isinstance(json.loads(obj.text), dict)
    with pytest.raises(ValueError, match="give at most one constraint"):
        client.generate("x", regex="a", choice=["a", "b"])


def test_a_bad_constraint_is_invalid_argument_naming_the_field(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.generate("x", regex="a(b")
    assert err.value.details.startswith("constraint.regex: at 1(8): invalid regex")
    (violation,) = err.value.field_violations
    assert violation.field == "constraint.regex"
    with pytest.raises(InvalidArgumentError) as err:
        client.generate("x", choice=["only"])
    assert err.value.details == "constraint.choice.choices: 1 given; give at least 2"


def test_constraint_messages_the_client_cannot_send(server: ServerThread) -> None:
    stub = generate_pb2_grpc.GenerateServiceStub(server.channel())
    cases = {
        "constraint: set one of json_schema, regex, grammar, choice, json_object": (
            generate_pb2.Constraint()
        ),
        "constraint.json_object: false; set it to true or unset it": generate_pb2.Constraint(
            json_object=False
        ),
    }
    for message, constraint in cases.items():
        request = generate_pb2.GenerateRequest(text="x")
        request.constraint.CopyFrom(constraint)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == message


def test_cli_structured_output_flags(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    base = ["--target", server.target, "generate", "--max-new-tokens", "60"]
    assert cli_main([*base, "JSON: ", "--json-schema", str(schema_file)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)
    assert cli_main([*base, "Pick: ", "--choice", "up,down"]) == 0
    assert capsys.readouterr().out.strip() in ("up", "down")
    assert cli_main([*base, "Num: ", "--regex", r"[0-9]{2}"]) == 0
    assert re.fullmatch(r"[0-9]{2}", capsys.readouterr().out.strip())
    grammar_file = tmp_path / "g.lark"
    grammar_file.write_text('start: "a" | "b"')
    assert cli_main([*base, "AB: ", "--grammar", str(grammar_file)]) == 0
    assert capsys.readouterr().out.strip() in ("a", "b")
    with pytest.raises(SystemExit):  # two constraints: argparse refuses
        cli_main([*base, "x", "--regex", "a", "--json-object"])
