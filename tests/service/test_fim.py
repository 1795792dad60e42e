"""Fill in the middle (GenerateRequest.fim): the prompt a model's FIM tokens
make, over gRPC, HTTP (OpenAI's `suffix`), the Python client and the CLI; the
exact error on a model without FIM tokens."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from genai_client import Client, InvalidArgumentError
from genai_client.cli import main as cli_main
from genai_service.config import EngineConfig, ServerConfig
from genai_service.model.tokenizer import Tokenizer
from tests.server_harness import ServerThread, free_port
from tests.tiny_model import BOS_ID, FIM_IDS, encode_words

PREFIX, SUFFIX = "the cat sat on", "and the dog ran"
NO_FIM = (
    "fim: the model's tokenizer has no fill-in-the-middle tokens (looked for "
    "<fim_prefix>/<fim_suffix>/<fim_middle>, <|fim_prefix|>/<|fim_suffix|>/<|fim_middle|>, "
    "<PRE>/<SUF>/<MID>, <｜fim▁begin｜>/<｜fim▁hole｜>/<｜fim▁end｜>, and a fim_tokens entry "
    "in tokenizer_config.json or genai_config.json)"
)


def psm_ids() -> list[int]:
    return [
        FIM_IDS["<fim_prefix>"],
        *encode_words(PREFIX),
        FIM_IDS["<fim_suffix>"],
        *encode_words(SUFFIX),
        FIM_IDS["<fim_middle>"],
    ]


def spm_ids() -> list[int]:
    return [
        FIM_IDS["<fim_prefix>"],
        FIM_IDS["<fim_suffix>"],
        *encode_words(SUFFIX),
        FIM_IDS["<fim_middle>"],
        *encode_words(PREFIX),
    ]


def start(model_dir: Path) -> ServerThread:
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(model_dir)), port=free_port(), http_port=0
    )
    return ServerThread(config).start()


@pytest.fixture(scope="module")
def server(fim_model_dir: Path) -> Iterator[ServerThread]:
    srv = start(fim_model_dir)
    yield srv
    srv.stop()


def test_the_tokenizer_finds_the_fim_tokens_and_builds_both_orders(fim_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(fim_model_dir)
    assert tok.fim is not None
    assert tok.fim.ends == (FIM_IDS["<fim_pad>"],)
    assert tok.fim_ids(PREFIX, SUFFIX, spm=False, add_special_tokens=False) == psm_ids()
    assert tok.fim_ids(PREFIX, SUFFIX, spm=True, add_special_tokens=False) == spm_ids()


def test_declared_fim_tokens_win(fim_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "declared"
    model.mkdir()
    for f in fim_model_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    # Any three tokens the vocabulary has (here plain words) once declared.
    config["fim_tokens"] = {"prefix": "red", "suffix": "blue", "middle": "green"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(model)
    assert tok.fim is not None
    assert tok.fim_ids("a", "b", spm=False, add_special_tokens=False) == encode_words(
        "red a blue b green"
    )


def test_fim_over_grpc_equals_the_token_ids_request(server: ServerThread) -> None:
    with Client(server.target) as client:
        assert client.model_info().fim_supported
        for mode, ids in (("psm", psm_ids()), ("spm", spm_ids())):
            fim = client.generate(
                fim_prefix=PREFIX, fim_suffix=SUFFIX, fim_mode=mode, max_new_tokens=8
            )
            plain = client.generate(
                token_ids=ids, max_new_tokens=8, stop_token_ids=[FIM_IDS["<fim_pad>"]]
            )
            assert fim.token_ids == plain.token_ids and fim.text == plain.text
            assert fim.usage.prompt_tokens == len(ids)
        # <fim_pad> stops a FIM answer: it is among the request's stop tokens.
        forced = client.generate(
            fim_prefix=PREFIX,
            fim_suffix=SUFFIX,
            max_new_tokens=8,
            logit_bias={FIM_IDS["<fim_pad>"]: 100},
        )
        assert forced.finish_reason == "STOP_SEQUENCE"
        assert list(forced.token_ids) == [FIM_IDS["<fim_pad>"]]
        with pytest.raises(ValueError, match="exactly one"):
            client.generate("x", fim_prefix="a")
        sid = client.create_session().session_id
        with pytest.raises(InvalidArgumentError) as err:
            client.generate(fim_prefix="a", fim_suffix="b", session_id=sid)
        assert err.value.details.startswith("fim: not allowed on a session turn")


def test_fim_over_http_is_openai_suffix(server: ServerThread) -> None:
    assert server.server is not None
    base = f"http://127.0.0.1:{server.server.http_port}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as sdk:
        answer = sdk.completions.create(
            model="default", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0
        )
    with Client(server.target) as client:
        fim = client.generate(fim_prefix=PREFIX, fim_suffix=SUFFIX, max_new_tokens=8)
    assert answer.choices[0].text == fim.text
    assert answer.usage is not None and answer.usage.prompt_tokens == len(psm_ids())


def test_cli_several_completions(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--target", server.target, "generate", "the cat", "-n", "2", "--temperature", "1"]
    assert cli_main([*argv, "--seed", "3", "--max-new-tokens", "4"]) == 0
    with Client(server.target) as client:
        want = client.generate("the cat", n=2, temperature=1.0, seed=3, max_new_tokens=4)
    lines = [f"[{c.index}] {c.text}" for c in want.completions]
    assert capsys.readouterr().out == "\n".join(lines) + "\n"


def test_cli_fim_flags(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--target", server.target, "generate", "--fim-prefix", PREFIX, "--fim-suffix", SUFFIX]
    assert cli_main([*argv, "--max-new-tokens", "8", "--fim-mode", "spm"]) == 0
    with Client(server.target) as client:
        want = client.generate(
            fim_prefix=PREFIX, fim_suffix=SUFFIX, fim_mode="spm", max_new_tokens=8
        )
    assert capsys.readouterr().out == want.text + "\n"


def test_a_model_without_fim_tokens_names_what_is_missing(tiny_model_dir: Path) -> None:
    srv = start(tiny_model_dir)
    try:
        with Client(srv.target) as client:
            assert not client.model_info().fim_supported
            with pytest.raises(InvalidArgumentError) as err:
                client.generate(fim_prefix="a", fim_suffix="b")
            assert err.value.details == NO_FIM
        assert srv.server is not None
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=60)
        body = {"model": "default", "prompt": "a", "suffix": "b"}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        assert response.status == 400
        assert answer["error"]["param"] == "suffix"
        assert answer["error"]["message"] == "suffix" + NO_FIM[len("fim") :]
    finally:
        srv.stop()


def test_bos_leads_a_fim_prompt_when_the_tokenizer_adds_it(tmp_path: Path) -> None:
    from tests.tiny_model import TinyModelSpec, build_tiny_model

    tok = Tokenizer.from_dir(build_tiny_model(tmp_path, TinyModelSpec(fim=True, add_bos=True)))
    assert tok.fim_ids(PREFIX, SUFFIX, spm=False, add_special_tokens=True) == [BOS_ID, *psm_ids()]
