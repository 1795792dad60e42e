"""docs/api.md stays true: every grpcurl request body parses into its method's
request message (unknown fields fail), every RPC is shown, and every flag the
limits table names exists."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2

from genai_proto.genai.v1 import generate_pb2, model_pb2, session_pb2

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
SERVICES = [
    generate_pb2.DESCRIPTOR.services_by_name["GenerateService"],
    session_pb2.DESCRIPTOR.services_by_name["SessionService"],
    model_pb2.DESCRIPTOR.services_by_name["ModelService"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
]
METHOD = re.compile(r"^(?:genai\.v1|grpc\.health\.v1)\.\w+/\w+$")
HEREDOC = re.compile(r"<<'EOF'\n(.*?)\nEOF\n", re.S)


def _shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", API.read_text(), re.S)


def _calls() -> list[tuple[str, list[str]]]:
    """(method, request bodies) of every grpcurl command in the doc."""
    calls = []
    for block in _shell_blocks():
        stdin = [m.group(1) for m in HEREDOC.finditer(block)]
        block = HEREDOC.sub("\n", block)
        words = shlex.split(block.replace("\\\n", " "), comments=True)
        starts = [i for i, w in enumerate(words) if w == "grpcurl"]
        for start, end in itertools.pairwise([*starts, len(words)]):
            command = words[start:end]
            methods = [w for w in command if METHOD.match(w)]
            if not methods:
                continue  # list / describe
            (method,) = methods
            body = command[command.index("-d") + 1]
            if body == "@":
                bodies = [line for line in stdin.pop(0).splitlines() if line.strip()]
            else:
                bodies = [body]
            calls.append((method, bodies))
    return calls


def _request_class(method: str) -> type:
    service, name = method.split("/")
    descriptor = descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]
    return message_factory.GetMessageClass(descriptor.input_type)


@pytest.mark.parametrize(("method", "bodies"), _calls())
def test_request_bodies_parse(method: str, bodies: list[str]) -> None:
    cls = _request_class(method)
    for body in bodies:
        json_format.Parse(body, cls())  # raises on an unknown field or a bad value


def test_every_rpc_has_an_example() -> None:
    shown = {method for method, _ in _calls()}
    for service in SERVICES:
        for method in service.methods:
            if service.name == "Health" and method.name != "Check":
                continue
            assert f"{service.full_name}/{method.name}" in shown, method.full_name


def _http_bodies() -> list[tuple[str, dict]]:
    """(kind, JSON body) of every curl call to a completions endpoint in the doc."""
    out = []
    for block in _shell_blocks():
        words = shlex.split(block.replace("\\\n", " "), comments=True)
        starts = [i for i, w in enumerate(words) if w == "curl"]
        for start, end in itertools.pairwise([*starts, len(words)]):
            command = words[start:end]
            urls = [w for w in command if w.startswith("http://")]
            if "-d" not in command or not urls:
                continue
            path = urls[0].split("/", 3)[3]
            kind = {"v1/chat/completions": "chat", "v1/completions": "completions"}.get(path)
            if kind:
                out.append((kind, json.loads(command[command.index("-d") + 1])))
    return out


def test_http_bodies_are_accepted() -> None:
    from genai_service.server.http_api.openai_api import parse

    bodies = _http_bodies()
    assert {kind for kind, _ in bodies} == {"chat", "completions"}
    for kind, body in bodies:
        parse(kind, body)  # raises InvalidArgument on an unknown field or a bad value


def test_limit_flags_exist() -> None:
    from genai_service.__main__ import build_parser

    options = build_parser()._option_string_actions
    table = API.read_text().split("## Limits", 1)[1]
    flags = re.findall(r"`(--[a-z-]+)`", table)
    assert flags
    for flag in flags:
        assert flag in options, flag
