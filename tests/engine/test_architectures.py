"""Llama 3.1 (RoPE scaling), Qwen2, Qwen3 and Gemma 3 against onnxruntime-genai's builder.

tests/engine/data/builder_reference.json was recorded once by
bench/builder_reference.py: the synthetic GGUF files of tests/synthetic_gguf.py,
dequantized by the ``gguf`` package into Hugging Face layout, exported by
``onnxruntime_genai.models.builder`` at fp32 and run by onnxruntime-genai's
greedy search (the file says which versions). The builder's graphs share no
code with our converter, so equal tokens and logits here mean each family's
graph (biases, QK-norm, head_dim != hidden / heads, the four Gemma norms,
GELU-tanh, sliding windows with their own RoPE base, Llama 3.1's frequency
factors) computes what the model means, not what we think it means. The
same file records that the builder's directories load in our engine and give
the same tokens there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from genai_service.config import EngineConfig, RunnerConfig, SchedulerConfig
from genai_service.contract.request import GenerationRequest, StoppingCriteria
from genai_service.convert.convert import ConvertOptions, convert
from genai_service.engine.engine import LLMEngine
from genai_service.engine.runner.model_runner import StepItem
from genai_service.model.model_dir import load_model_spec
from tests.synthetic_gguf import ARCHS, SHAPES, write_synthetic_gguf

REFERENCE = json.loads((Path(__file__).parent / "data" / "builder_reference.json").read_text())


@pytest.fixture(scope="module", params=ARCHS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    gguf = write_synthetic_gguf(d / f"{arch}.gguf", arch)
    return arch, gguf, convert(gguf, d / "fp32", ConvertOptions(weights="fp32"), progress=False)


def test_the_synthetic_file_is_the_one_recorded(converted) -> None:
    arch, gguf, _ = converted
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == REFERENCE["models"][arch]["gguf_sha256"]


def test_greedy_tokens_and_logits_equal_the_builder(converted) -> None:
    arch, _, model_dir = converted
    ref = REFERENCE["models"][arch]["prompts"]
    assert sum(len(p["tokens"]) == REFERENCE["new_tokens"] for p in ref) >= 5
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            runner=RunnerConfig(intra_op_threads=2),
            scheduler=SchedulerConfig(max_num_seqs=len(ref)),
        )
    )
    stop = StoppingCriteria(max_new_tokens=REFERENCE["new_tokens"])
    reqs = [GenerationRequest(f"p{i}", tuple(p["ids"]), stopping=stop) for i, p in enumerate(ref)]
    out = eng.run_to_completion(reqs)  # batched, as served
    for req, p in zip(reqs, ref, strict=True):
        assert list(out[req.request_id].token_ids) == p["tokens"], (arch, len(p["ids"]))
        # the recorded run: the builder's own directory gave the same tokens in our engine
        assert p["ours_on_builder_dir"] == p["tokens"]
    for p in ref:
        row = eng.runner.run([StepItem(1, tuple(p["ids"]), 0)])[0]
        eng.runner.release(1)
        want = np.array(p["top_logits"], dtype=np.float32)
        np.testing.assert_allclose(row[p["top_ids"]], want, atol=2e-3 * np.abs(want).max())


def test_per_layer_windows_reach_the_model_spec(converted) -> None:
    arch, _, model_dir = converted
    shape = SHAPES[arch]
    want = tuple(shape.window if shape.window and (i + 1) % 6 else 0 for i in range(shape.layers))
    assert load_model_spec(model_dir).attention_windows == want


def test_speculation_checks_several_sequences_in_one_call_where_the_graph_allows(
    converted,
) -> None:
    """The converter's graphs (packed q|k|v, rotary in the node; Gemma 3's
    sliding-window layers, each kind with its own rotary tables) have a twin
    that checks several sequences at once, with the same logits and KV as one
    call per sequence: here with contexts past Gemma 3's 16-token window."""
    from tests.engine.test_shared_buffer_runner import twin_matches_one_call_per_item

    arch, _, model_dir = converted
    assert twin_matches_one_call_per_item(model_dir, atol=1e-3, lengths=(20, 2, 31)) is None
