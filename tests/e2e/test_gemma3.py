"""Gemma 3 270M (the second named model) against llama.cpp (slow).

tests/e2e/data/gemma3_golden.json is llama.cpp's own tokenization of a corpus
and its greedy continuations of fixed prompts on the same Q4_K_M file,
recorded once by bench/gemma3_golden.py (the file says which llama.cpp). Our
int8 conversion keeps the file's Q8_0/Q5_0 tensors exactly and moves its
Q4_K/Q6_K ones to int8 within one step; llama.cpp quantizes activations its
own way, so near-ties may break differently: the free-running continuation is
checked on its first token, and every recorded token is checked against our
logits at the same position (teacher forcing).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from genai_service.config import EngineConfig, RunnerConfig, SchedulerConfig, ServerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.engine.engine import LLMEngine
from genai_service.engine.runner.model_runner import StepItem
from tests.server_harness import ServerThread, free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

GOLDEN = json.loads((Path(__file__).parent / "data" / "gemma3_golden.json").read_text("utf-8"))
LAYERS = 18
WINDOW = 512  # gemma3.attention.sliding_window; every sixth layer is global


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    from genai_service.convert.default_model import resolve_model

    return resolve_model("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma3(gemma3_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(gemma3_dir),
            runner=RunnerConfig(intra_op_threads=2),
            scheduler=SchedulerConfig(max_num_seqs=len(GOLDEN["prompts"])),
        )
    )


def test_tokenizer_ids_equal_llama_cpp_on_the_corpus(gemma3: LLMEngine) -> None:
    tok = gemma3.tokenizer
    corpus = GOLDEN["corpus"]
    assert len(corpus) >= 200
    differ = [
        line["text"]
        for line in corpus
        if list(tok.encode(line["text"], add_special_tokens=False)) != line["ids"]
    ]
    assert differ == []
    for line in corpus:  # and back: byte fallback and the ▁ space round-trip
        assert tok.decode(line["ids"]) == line["text"], line["text"]
    # prompts: BOS first, from the GGUF's add_bos_token
    for p in GOLDEN["prompts"]:
        assert list(tok.encode(p["prompt"])) == p["ids"]


def test_greedy_tokens_agree_with_llama_cpp(gemma3: LLMEngine) -> None:
    prompts = GOLDEN["prompts"]
    n = GOLDEN["new_tokens"]
    reqs = [
        GenerationRequest(
            f"g{i}", tuple(p["ids"]), stopping=StoppingCriteria(max_new_tokens=n, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    out = gemma3.run_to_completion(reqs)
    first_equal = sum(
        out[r.request_id].token_ids[0] == p["greedy"][0] for r, p in zip(reqs, prompts, strict=True)
    )
    assert first_equal >= 9, first_equal
    # teacher forcing: at every recorded position llama.cpp's token is ours or a near-tie
    runner = gemma3.runner
    exact = total = 0
    for p in prompts:
        ids, gold = tuple(p["ids"]), p["greedy"]
        first = runner.run([StepItem(1, ids, 0)])[0]
        rows = [first, *runner.verify(StepItem(1, tuple(gold[:-1]), len(ids)))]
        runner.release(1)
        for j, row in enumerate(rows):
            gap = float(row.max() - row[gold[j]])
            assert gap < 0.5, (p["prompt"], j, gap)
            exact += int(np.argmax(row)) == gold[j]
            total += 1
    assert exact >= 0.9 * total, (exact, total)


@pytest.fixture(scope="module")
def server(gemma3_dir: Path) -> Iterator[ServerThread]:
    config = ServerConfig(
        engine=EngineConfig(model_dir=str(gemma3_dir), runner=RunnerConfig(intra_op_threads=2)),
        port=free_port(),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


def test_served_model_info_and_tokens(server: ServerThread, gemma3: LLMEngine) -> None:
    from genai_client import Client

    p = GOLDEN["prompts"][3]
    with Client(server.target) as client:
        info = client.model_info()
        assert info.vocab_size == 262_144
        assert info.kv_layout.num_layers == LAYERS
        assert info.kv_layout.num_kv_heads == 1 and info.kv_layout.head_dim == 256
        assert info.attention_windows == tuple(
            0 if (i + 1) % 6 == 0 else WINDOW for i in range(LAYERS)
        )
        assert not info.has_chat_template  # a base model: text or token ids only
        got = client.generate(token_ids=p["ids"], max_new_tokens=16, ignore_eos=True)
    assert list(got.token_ids) == p["greedy"][:16]


def test_model_name_resolves_on_the_command_line(gemma3_dir: Path) -> None:
    from genai_service.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--model", "gemma3-270m"])
    assert Path(config_from_args(args).engine.model_dir) == gemma3_dir


def test_fp32_conversion_equals_the_builder_on_the_same_weights() -> None:
    """onnxruntime-genai's builder at fp32 on the file's weights in Hugging Face
    layout (tests/e2e/data/gemma3_builder.json, bench/builder_reference.py):
    the same greedy tokens, the last prompt 1,500 tokens long (past the local
    layers' 512-token window), and the same top logits after each prompt."""
    from genai_service.convert.convert import sha256_file
    from genai_service.convert.default_model import gemma3_gguf, resolve_model

    ref = json.loads((Path(__file__).parent / "data" / "gemma3_builder.json").read_text("utf-8"))
    assert sha256_file(gemma3_gguf().path) == ref["gguf_sha256"]
    prompts = ref["prompts"]
    assert max(len(p["ids"]) for p in prompts) > 2 * WINDOW
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(resolve_model("gemma3-270m", weights="fp32", progress=False)),
            runner=RunnerConfig(intra_op_threads=2),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
        )
    )
    stop = StoppingCriteria(max_new_tokens=ref["new_tokens"])
    reqs = [
        GenerationRequest(f"b{i}", tuple(p["ids"]), stopping=stop) for i, p in enumerate(prompts)
    ]
    out = eng.run_to_completion(reqs)  # chunked prefill of the long prompt, batched decode
    for req, p in zip(reqs, prompts, strict=True):
        assert list(out[req.request_id].token_ids) == p["tokens"], len(p["ids"])
        assert p["ours_on_builder_dir"] == p["tokens"]  # the builder's directory, in our engine
    for p in prompts:
        row = eng.runner.run([StepItem(1, tuple(p["ids"]), 0)])[0]
        eng.runner.release(1)
        want = np.array(p["top_logits"], dtype=np.float32)
        np.testing.assert_allclose(row[p["top_ids"]], want, atol=2e-3 * np.abs(want).max())
