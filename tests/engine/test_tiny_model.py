"""Tests of the tiny-model test bed: the graph honours the model directory contract (docs/design.md, "Model directory") and the KV path,
left-padded batches and the GQA variant all agree with the full-recompute reference."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jinja2
import numpy as np
import onnx
import pytest
import yaml
from tokenizers import Tokenizer

from tests.tiny_model import (
    BOS_ID,
    EOS_ID,
    GQA_SPEC,
    VOCAB_SIZE,
    WORDS,
    TinyModelSpec,
    build_tiny_model,
    decode_ids,
    encode_words,
    make_feed,
    reference_greedy,
    reference_logits,
    run_model,
)

PROMPTS = [
    "the cat sat on the mat",
    "hello",
    "who are you ? i am a dog and i ran under the tree",
    "the old red box was here one day . it is not here now",
]
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    specs = {
        "rope": TinyModelSpec(),
        "learned": TinyModelSpec(positions="learned"),
        "gqa": GQA_SPEC,
        "gqa_twin": dataclasses.replace(GQA_SPEC, attention="standard"),
        "gqa_learned": dataclasses.replace(GQA_SPEC, positions="learned"),
        "gqa_learned_twin": dataclasses.replace(
            GQA_SPEC, positions="learned", attention="standard"
        ),
    }
    return {name: build_tiny_model(root / name, spec) for name, spec in specs.items()}


def _ids(text: str) -> list[int]:
    ids = [BOS_ID, *encode_words(text)]
    assert 0 not in ids, text  # every prompt word is in the vocabulary
    return ids


# ---------------------------------------------------------------------------------------------
# build


@pytest.mark.parametrize(
    "spec",
    [
        TinyModelSpec(),
        TinyModelSpec(positions="learned", config="inference_metadata"),
        dataclasses.replace(GQA_SPEC, config="none", chat_template=False),
    ],
)
def test_build_is_fast_and_writes_files(tmp_path: Path, spec: TinyModelSpec) -> None:
    start = time.perf_counter()
    out = build_tiny_model(tmp_path / "m", spec)
    assert time.perf_counter() - start < 2.0
    assert out == tmp_path / "m"
    names = {p.name for p in out.iterdir()}
    expected = {"model.onnx", "tokenizer.json"}
    expected |= {
        "genai_config": {"genai_config.json"},
        "inference_metadata": {"inference_metadata.yaml"},
        "none": set(),
    }[spec.config]
    if spec.chat_template:
        expected.add("tokenizer_config.json")
    assert names == expected


def test_build_is_deterministic(tmp_path: Path) -> None:
    for spec in (TinyModelSpec(), GQA_SPEC):
        a = build_tiny_model(tmp_path / "a", spec)
        b = build_tiny_model(tmp_path / "b", spec)
        for name in ("model.onnx", "tokenizer.json", "genai_config.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_tiny_model(tmp_path / "c", TinyModelSpec(seed=1))
    assert (c / "model.onnx").read_bytes() != (tmp_path / "a" / "model.onnx").read_bytes()


@pytest.mark.parametrize("name", ["rope", "learned", "gqa", "gqa_learned"])
def test_graph_contract(models: dict[str, Path], name: str) -> None:
    model = onnx.load(str(models[name] / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    spec_heads, dim = (2, 16) if name.startswith("gqa") else (2, 8)

    def dims(vi: onnx.ValueInfoProto) -> list[str | int]:
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    ins = {vi.name: vi for vi in model.graph.input}
    outs = {vi.name: vi for vi in model.graph.output}
    assert dims(ins["input_ids"]) == ["batch_size", "sequence_length"]
    assert dims(ins["attention_mask"]) == ["batch_size", "total_sequence_length"]
    assert ins["input_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert ins["attention_mask"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    # GQA with rope rotates from seqlens_k internally, so it has no position_ids input
    assert ("position_ids" in ins) == (name != "gqa")
    assert dims(outs["logits"]) == ["batch_size", "sequence_length", VOCAB_SIZE]
    for i in range(2):
        for kind in ("key", "value"):
            past = ins[f"past_key_values.{i}.{kind}"]
            assert dims(past) == ["batch_size", spec_heads, "past_sequence_length", dim]
            assert past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
            assert dims(outs[f"present.{i}.{kind}"]) == [
                "batch_size",
                spec_heads,
                "total_sequence_length",
                dim,
            ]
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert (("com.microsoft", "GroupQueryAttention") in ops) == name.startswith("gqa")
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports[""] == 17


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="hidden"):
        TinyModelSpec(hidden=30)
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelSpec(num_kv_heads=3)
    with pytest.raises(ValueError, match="positions"):
        TinyModelSpec(positions="alibi")
    with pytest.raises(ValueError, match="multiple of 16"):
        TinyModelSpec(attention="gqa")


# ---------------------------------------------------------------------------------------------
# tokenizer and config files


def test_tokenizer_and_vocab(models: dict[str, Path]) -> None:
    assert WORDS[:3] == ["<unk>", "<s>", "</s>"] and len(WORDS) == VOCAB_SIZE
    assert len(set(WORDS)) == VOCAB_SIZE and VOCAB_SIZE >= 60
    tok = Tokenizer.from_file(str(models["rope"] / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE
    ids = tok.encode("the cat sat").ids
    assert ids == encode_words("the cat sat")
    assert tok.decode(ids) == "the cat sat" == decode_ids(ids)
    assert tok.decode([BOS_ID, *ids, EOS_ID]) == "the cat sat"
    assert tok.encode("zebra the").ids == [0, WORDS.index("the")]
    assert tok.encode("<s> the </s>").ids == [BOS_ID, WORDS.index("the"), EOS_ID]


def test_tokenizer_add_bos(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path, TinyModelSpec(add_bos=True))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("the cat").ids == [BOS_ID, *encode_words("the cat")]
    assert tok.encode("the cat", add_special_tokens=False).ids == encode_words("the cat")


def test_chat_template_renders_known_words(models: dict[str, Path]) -> None:
    cfg = json.loads((models["rope"] / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<s>" and cfg["eos_token"] == "</s>"
    template = jinja2.Environment().from_string(cfg["chat_template"])
    messages = [
        {"role": "system", "content": "you are good"},
        {"role": "user", "content": "hello ! who are you ?"},
    ]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text.endswith("<s> assistant : ")
    tok = Tokenizer.from_file(str(models["rope"] / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert 0 not in ids and ids.count(BOS_ID) == 3 and ids.count(EOS_ID) == 2
    no_prompt = template.render(messages=messages, add_generation_prompt=False)
    assert not no_prompt.rstrip().endswith(":")


def test_genai_config(models: dict[str, Path]) -> None:
    cfg = json.loads((models["gqa"] / "genai_config.json").read_text())
    m = cfg["model"]
    assert m["context_length"] == 128 and m["vocab_size"] == VOCAB_SIZE
    assert (m["eos_token_id"], m["bos_token_id"], m["pad_token_id"]) == (EOS_ID, BOS_ID, 0)
    dec = m["decoder"]
    assert (dec["num_hidden_layers"], dec["num_attention_heads"]) == (2, 4)
    assert (dec["num_key_value_heads"], dec["head_size"], dec["hidden_size"]) == (2, 16, 64)
    assert "position_ids" not in dec["inputs"]
    assert cfg["search"]["max_length"] == 128
    assert cfg["search"]["past_present_share_buffer"] is True


def test_inference_metadata(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path, TinyModelSpec(config="inference_metadata", max_seq_len=64))
    meta = yaml.safe_load((out / "inference_metadata.yaml").read_text())
    assert meta["model"]["max_sequence_length"] == 64
    assert meta["model"]["eos_token_id"] == EOS_ID
    assert meta["model"]["vocab_size"] == VOCAB_SIZE
    assert meta["model"]["attention"]["num_kv_heads"] == 2


# ---------------------------------------------------------------------------------------------
# numerics


def _kv_logits(model_dir: Path, ids: list[int], chunks: list[int]) -> list[np.ndarray]:
    """Feed `ids` in chunks of the given sizes (then single tokens), present → past each time;
    returns last-position logits after every chunk."""
    sizes = chunks + [1] * (len(ids) - sum(chunks))
    past = None
    pos = 0
    result = []
    for size in sizes:
        feed = make_feed(model_dir, np.array([ids[pos : pos + size]]), past=past)
        logits, past = run_model(model_dir, feed)
        assert past[0].shape[2] == pos + size
        pos += size
        result.append(logits[0, -1])
    return result


@pytest.mark.parametrize("name", ["rope", "learned"])
@pytest.mark.parametrize("chunks", [[1], [3], [2, 3]])
def test_kv_path_matches_full_recompute(
    models: dict[str, Path], name: str, chunks: list[int]
) -> None:
    for prompt in PROMPTS:
        ids = _ids(prompt)
        if sum(chunks) > len(ids):
            continue
        got = _kv_logits(models[name], ids, chunks)
        ends = np.cumsum(chunks + [1] * (len(ids) - sum(chunks)))
        for logits, end in zip(got, ends, strict=True):
            np.testing.assert_allclose(
                logits, reference_logits(models[name], ids[:end]), atol=ATOL, rtol=0
            )


def _left_pad(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros_like(ids)
    pos = np.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = row
        mask[r, width - len(row) :] = 1
        pos[r, width - len(row) :] = np.arange(len(row))
    return ids, mask, pos


@pytest.mark.parametrize("name", ["rope", "learned"])
def test_left_padded_batch_equals_single_rows(models: dict[str, Path], name: str) -> None:
    model = models[name]
    rows = [_ids(PROMPTS[2]), _ids(PROMPTS[0])]
    ids, mask, pos = _left_pad(rows)
    logits, past = run_model(model, make_feed(model, ids, mask, pos))
    for r, row in enumerate(rows):
        np.testing.assert_allclose(logits[r, -1], reference_logits(model, row), atol=1e-5)
    assert np.isfinite(logits).all()  # fully masked padding rows stay finite
    # batched decode: each row appends its own greedy token at its own true position
    for _ in range(4):
        nxt = logits[:, -1].argmax(-1)
        for r, row in enumerate(rows):
            row.append(int(nxt[r]))
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        step_pos = np.array([[len(row) - 1] for row in rows])
        logits, past = run_model(model, make_feed(model, nxt[:, None], mask, step_pos, past))
        for r, row in enumerate(rows):
            np.testing.assert_allclose(logits[r, -1], reference_logits(model, row), atol=1e-5)


def test_zero_padded_past_merge_equals_single_rows(models: dict[str, Path]) -> None:
    """Pasts computed separately, left-padded with zeros into one batch, decode together."""
    model = models["rope"]
    rows = [_ids(PROMPTS[3]), _ids(PROMPTS[1])]
    pasts = [run_model(model, make_feed(model, np.array([row[:-1]])))[1] for row in rows]
    width = max(len(row) - 1 for row in rows)
    merged = []
    for layer_kv in zip(*pasts, strict=True):  # one tensor per row, [1, kv, len, d]
        buf = np.zeros((2, *layer_kv[0].shape[1:2], width, layer_kv[0].shape[3]), np.float32)
        for r, t in enumerate(layer_kv):
            buf[r, :, width - t.shape[2] :] = t[0]
        merged.append(buf)
    mask = np.zeros((2, width + 1), np.int64)
    for r, row in enumerate(rows):
        mask[r, width + 1 - len(row) :] = 1
    last = np.array([[row[-1]] for row in rows])
    pos = np.array([[len(row) - 1] for row in rows])
    logits, _ = run_model(model, make_feed(model, last, mask, pos, merged))
    for r, row in enumerate(rows):
        np.testing.assert_allclose(logits[r, -1], reference_logits(model, row), atol=1e-5)


@pytest.mark.parametrize("name", ["rope", "learned", "gqa"])
def test_greedy_is_varied(models: dict[str, Path], name: str) -> None:
    out = reference_greedy(models[name], _ids(PROMPTS[0]), 20)
    assert len(out) == 20
    assert len(set(out)) > 5
    assert 0 not in out and BOS_ID not in out  # <unk>/<s> logits are pinned to 0


def test_greedy_stops_after_eos(models: dict[str, Path]) -> None:
    model = models["rope"]
    full = reference_greedy(model, _ids(PROMPTS[0]), 10)
    stop = full[3]
    got = reference_greedy(model, _ids(PROMPTS[0]), 10, eos_ids=(stop,))
    assert got == full[: full.index(stop) + 1]


# ---------------------------------------------------------------------------------------------
# GroupQueryAttention variant


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_gqa_matches_standard(models: dict[str, Path], positions: str) -> None:
    gqa = models["gqa" if positions == "rope" else "gqa_learned"]
    std = models["gqa_twin" if positions == "rope" else "gqa_learned_twin"]
    for prompt in PROMPTS:
        ids = _ids(prompt)
        np.testing.assert_allclose(
            reference_logits(gqa, ids), reference_logits(std, ids), atol=ATOL, rtol=0
        )
    ids = _ids(PROMPTS[2])
    for logits, end in zip(_kv_logits(gqa, ids, [3]), range(3, len(ids) + 1), strict=True):
        np.testing.assert_allclose(logits, reference_logits(std, ids[:end]), atol=ATOL, rtol=0)


def test_gqa_right_padded_and_shared_buffer_past(models: dict[str, Path]) -> None:
    """GQA reads valid KV from the start of each row (right padding), and accepts a
    max_seq_len past buffer (the shared-buffer layout), returning a same-size present."""
    gqa, std = models["gqa"], models["gqa_twin"]
    rows = [_ids(PROMPTS[2]), _ids(PROMPTS[0])]
    pasts = [run_model(gqa, make_feed(gqa, np.array([row[:-1]])))[1] for row in rows]
    cap = GQA_SPEC.max_seq_len
    buffers = []
    for layer_kv in zip(*pasts, strict=True):
        buf = np.zeros((2, 2, cap, 16), np.float32)
        for r, t in enumerate(layer_kv):
            buf[r, :, : t.shape[2]] = t[0]
        buffers.append(buf)
    # seqlens_k = sum(mask) - 1 = row length - 1; total_sequence_length = mask width
    width = max(map(len, rows))
    mask = np.zeros((2, width), np.int64)
    for r, row in enumerate(rows):
        mask[r, : len(row)] = 1
    last = np.array([[row[-1]] for row in rows])
    logits, presents = run_model(gqa, make_feed(gqa, last, mask, past=buffers))
    assert presents[0].shape == (2, 2, cap, 16)
    for r, row in enumerate(rows):
        np.testing.assert_allclose(logits[r, -1], reference_logits(std, row), atol=ATOL, rtol=0)
        # the new token's K landed right after the row's valid prefix
        np.testing.assert_array_equal(
            presents[0][r, :, : len(row) - 1], buffers[0][r, :, : len(row) - 1]
        )
        assert np.abs(presents[0][r, :, len(row) - 1]).sum() > 0
