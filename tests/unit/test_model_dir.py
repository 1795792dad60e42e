"""load_model_spec: graph introspection, config precedence, load errors, fingerprint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from genai_common.errors import ModelLoadError
from genai_service.model.model_dir import KvLayout, load_model_spec

# Word-level vocabulary shared by the model and tokenizer tests; ids 0-4 are special.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ["hello", "world", "the", "cat", "sat", "user", "assistant", "system", "hi", "bye"]
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
VOCAB_SIZE = len(VOCAB)
HIDDEN = 8

Shape = Sequence[int | str | None]


def write_word_tokenizer(directory: Path, special: Sequence[str] = SPECIAL_TOKENS) -> None:
    """A whitespace word-level tokenizer.json over VOCAB."""
    tok = RawTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special))
    tok.save(str(directory / "tokenizer.json"))


def make_decoder_graph(
    num_layers: int = 2,
    kv_heads: int | str = 2,
    head_dim: int | str = 4,
    kv_dtype: int = TensorProto.FLOAT,
    logits_shape: Shape = ("batch", "seq", VOCAB_SIZE),
    attention_mask: bool = True,
    position_ids: bool = True,
    gqa: bool = False,
    metadata: dict[str, str] | None = None,
) -> onnx.ModelProto:
    """A small decoder with correct I/O declarations (its numbers mean nothing).

    logits = Gather(embedding, input_ids) @ lm_head; present.i = Identity(past.i).
    """
    kv_shape = ["batch", kv_heads, "past_seq", head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
    if attention_mask:
        inputs.append(
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])
        )
    if position_ids:
        inputs.append(
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])
        )
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(logits_shape))]
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "lm_head"], ["logits"]),
    ]
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((VOCAB_SIZE, HIDDEN), np.float32), "embedding"),
        numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB_SIZE), np.float32), "lm_head"),
    ]
    for i in range(num_layers):
        for kind in ("key", "value"):
            past, present = f"past_key_values.{i}.{kind}", f"present.{i}.{kind}"
            inputs.append(helper.make_tensor_value_info(past, kv_dtype, kv_shape))
            outputs.append(helper.make_tensor_value_info(present, kv_dtype, kv_shape))
            nodes.append(helper.make_node("Identity", [past], [present]))
    if gqa:
        # Only its presence matters for loading; it is never run here.
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                ["hidden"],
                ["gqa_out"],
                domain="com.microsoft",
                num_heads=4,
                kv_num_heads=2,
            )
        )
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 17)]
    if gqa:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets)
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    return model


def make_io_graph(
    inputs: Sequence[tuple[str, int, Shape]],
    outputs: Sequence[tuple[str, int, Shape]],
) -> onnx.ModelProto:
    """A graph that only declares I/O (enough for load errors; never run)."""
    graph = helper.make_graph(
        [],
        "io_only",
        [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def kv_io(
    layers: Sequence[int] = (0, 1),
    dtype: int = TensorProto.FLOAT,
    shape: Shape = ("batch", 2, "past", 4),
) -> tuple[list[tuple[str, int, Shape]], list[tuple[str, int, Shape]]]:
    past = [(f"past_key_values.{i}.{k}", dtype, shape) for i in layers for k in ("key", "value")]
    present = [(f"present.{i}.{k}", dtype, shape) for i in layers for k in ("key", "value")]
    return past, present


IDS: tuple[str, int, Shape] = ("input_ids", TensorProto.INT64, ("batch", "seq"))
LOGITS: tuple[str, int, Shape] = ("logits", TensorProto.FLOAT, ("batch", "seq", VOCAB_SIZE))


def write_model_dir(
    directory: Path,
    model: onnx.ModelProto | None = None,
    *,
    genai_config: dict[str, Any] | None = None,
    inference_metadata: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    tokenizer: bool = True,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model if model is not None else make_decoder_graph(), str(directory / "model.onnx"))
    if tokenizer:
        write_word_tokenizer(directory)
    if genai_config is not None:
        (directory / "genai_config.json").write_text(json.dumps(genai_config))
    if inference_metadata is not None:
        (directory / "inference_metadata.yaml").write_text(yaml.safe_dump(inference_metadata))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def genai_config(**model: Any) -> dict[str, Any]:
    return {
        "model": {
            "bos_token_id": 1,
            "context_length": 2048,
            "decoder": {"filename": "model.onnx", "head_size": 4, "num_key_value_heads": 2},
            "eos_token_id": [2, 4],
            "pad_token_id": 0,
            "type": "llama",
            "vocab_size": 32000,
            **model,
        },
        "search": {
            "do_sample": False,
            "max_length": 2048,
            "repetition_penalty": 1.1,
            "temperature": 0.7,
            "top_k": 40,
            "top_p": 0.9,
        },
    }


def load_error(directory: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model_spec(directory)
    return str(info.value)


# --- valid directories -----------------------------------------------------------------


def test_directory_with_genai_config(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "tiny-llama", genai_config=genai_config())
    spec = load_model_spec(d)
    assert spec.path == d.resolve()
    assert spec.onnx_path == d.resolve() / "model.onnx"
    assert spec.model_id == "tiny-llama"
    assert spec.kv == KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
    assert spec.vocab_size == VOCAB_SIZE  # the graph's static logits dim wins over the config
    assert spec.input_names == (
        "input_ids",
        "attention_mask",
        "position_ids",
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    )
    assert spec.has_attention_mask and spec.has_position_ids
    assert spec.past_names == (
        ("past_key_values.0.key", "past_key_values.0.value"),
        ("past_key_values.1.key", "past_key_values.1.value"),
    )
    assert spec.present_names == (
        ("present.0.key", "present.0.value"),
        ("present.1.key", "present.1.value"),
    )
    assert not spec.uses_gqa
    assert not spec.logits_last_only
    assert spec.context_length == 2048
    assert spec.eos_token_ids == (2, 4)
    assert spec.bos_token_id == 1
    assert spec.pad_token_id == 0
    assert spec.sampling_defaults == {
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "do_sample": 0,  # the engine applies author defaults only when this is 1
    }
    assert spec.chat_template is None
    assert re.fullmatch(r"[0-9a-f]{32}", spec.fingerprint)


def test_genai_config_supplies_symbolic_kv_dims_and_vocab(tmp_path: Path) -> None:
    model = make_decoder_graph(
        kv_heads="kv_heads", head_dim="head_dim", logits_shape=("batch", "seq", "vocab")
    )
    d = write_model_dir(tmp_path / "m", model, genai_config=genai_config(vocab_size=32000))
    spec = load_model_spec(d)
    assert (spec.kv.num_kv_heads, spec.kv.head_dim) == (2, 4)
    assert spec.vocab_size == 32000


def test_genai_config_names_the_model_file(tmp_path: Path) -> None:
    cfg = genai_config()
    cfg["model"]["decoder"]["filename"] = "decoder.onnx"
    d = write_model_dir(tmp_path / "m", genai_config=cfg)
    (d / "model.onnx").rename(d / "decoder.onnx")
    assert load_model_spec(d).onnx_path.name == "decoder.onnx"
    (d / "decoder.onnx").unlink()
    assert load_error(d) == f"{d.resolve() / 'decoder.onnx'}: model file not found"


def test_genai_config_kv_name_patterns(tmp_path: Path) -> None:
    inputs = [IDS] + [
        (f"past_{k}_{i}", TensorProto.FLOAT, ("batch", 2, "past", 4))
        for i in range(2)
        for k in ("k", "v")
    ]
    outputs = [LOGITS] + [
        (f"present_{k}_{i}", TensorProto.FLOAT, ("batch", 2, "total", 4))
        for i in range(2)
        for k in ("k", "v")
    ]
    cfg = genai_config()
    cfg["model"]["decoder"]["inputs"] = {
        "input_ids": "input_ids",
        "past_key_names": "past_k_%d",
        "past_value_names": "past_v_%d",
    }
    cfg["model"]["decoder"]["outputs"] = {
        "logits": "logits",
        "present_key_names": "present_k_%d",
        "present_value_names": "present_v_%d",
    }
    d = write_model_dir(tmp_path / "m", make_io_graph(inputs, outputs), genai_config=cfg)
    spec = load_model_spec(d)
    assert spec.past_names == (("past_k_0", "past_v_0"), ("past_k_1", "past_v_1"))
    assert spec.present_names == (("present_k_0", "present_v_0"), ("present_k_1", "present_v_1"))
    assert not spec.has_attention_mask and not spec.has_position_ids


def test_genai_config_renamed_input_ids_is_refused(tmp_path: Path) -> None:
    cfg = genai_config()
    cfg["model"]["decoder"]["inputs"] = {"input_ids": "inputIds"}
    d = write_model_dir(tmp_path / "m", genai_config=cfg)
    assert load_error(d) == (
        "genai_config.json: tensor 'input_ids' renamed to 'inputIds' is not supported "
        "(the engine uses 'input_ids')"
    )


def test_directory_with_inference_metadata(tmp_path: Path) -> None:
    model = make_decoder_graph(kv_heads="h", head_dim="d", logits_shape=("b", 1, "vocab"))
    meta = {
        "model": {
            "max_sequence_length": 4096,
            "eos_token_id": 2,
            "bos_token_id": 1,
            "attention": {"type": "grouped_query", "num_kv_heads": 2, "head_dim": 4},
        },
        "generation": {"temperature": 0.6, "top_p": 0.95},
    }
    d = write_model_dir(tmp_path / "m", model, inference_metadata=meta)
    spec = load_model_spec(d)
    assert spec.context_length == 4096
    assert spec.eos_token_ids == (2,)
    assert spec.bos_token_id == 1
    assert spec.pad_token_id is None
    assert spec.kv == KvLayout(2, 2, 4, "float32")
    assert spec.vocab_size == VOCAB_SIZE  # from the tokenizer: no static dim, no config
    assert spec.logits_last_only  # the seq dim is the static 1
    assert spec.sampling_defaults == {"temperature": 0.6, "top_p": 0.95}


def test_inference_metadata_tokens_section_with_eos_list(tmp_path: Path) -> None:
    meta = {"model": {"max_sequence_length": 512}, "tokens": {"eos_token_id": [4, 2, 4]}}
    spec = load_model_spec(write_model_dir(tmp_path / "m", inference_metadata=meta))
    assert spec.eos_token_ids == (4, 2)  # duplicates dropped, order kept


def test_genai_config_wins_over_inference_metadata(tmp_path: Path) -> None:
    meta = {"model": {"max_sequence_length": 4096, "eos_token_id": 3}}
    d = write_model_dir(
        tmp_path / "m", genai_config=genai_config(eos_token_id=2), inference_metadata=meta
    )
    spec = load_model_spec(d)
    assert spec.context_length == 2048
    assert spec.eos_token_ids == (2,)


def test_directory_without_configs_falls_back_to_graph_and_tokenizer(tmp_path: Path) -> None:
    spec = load_model_spec(write_model_dir(tmp_path / "bare"))
    assert spec.model_id == "bare"
    assert spec.kv == KvLayout(2, 2, 4, "float32")
    assert spec.vocab_size == VOCAB_SIZE
    assert spec.context_length is None
    # </s> and <|im_end|> are both in the tokenizer; both count as EOS.
    assert spec.eos_token_ids == (VOCAB["</s>"], VOCAB["<|im_end|>"])
    assert spec.bos_token_id is None and spec.pad_token_id is None
    assert spec.sampling_defaults == {}
    assert spec.chat_template is None


def test_tokenizer_config_names_special_tokens(tmp_path: Path) -> None:
    tok_cfg = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": "<unk>",
        "chat_template": "{{ messages[0]['content'] }}",
    }
    spec = load_model_spec(write_model_dir(tmp_path / "m", tokenizer_config=tok_cfg))
    assert spec.eos_token_ids == (VOCAB["<|im_end|>"],)
    assert spec.bos_token_id == VOCAB["<s>"]
    assert spec.pad_token_id == VOCAB["<unk>"]
    assert spec.chat_template == "{{ messages[0]['content'] }}"


def test_chat_template_from_jinja_file(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ bos_token }}")
    assert load_model_spec(d).chat_template == "{{ bos_token }}"


def test_model_name_from_config(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", genai_config=genai_config(name="smollm2-135m"))
    assert load_model_spec(d).model_id == "smollm2-135m"


def test_float16_kv(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", make_decoder_graph(kv_dtype=TensorProto.FLOAT16))
    assert load_model_spec(d).kv.dtype == "float16"


def test_group_query_attention_detected(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", make_decoder_graph(gqa=True))
    assert load_model_spec(d).uses_gqa


def test_group_query_attention_in_another_domain_is_not_gqa(tmp_path: Path) -> None:
    model = make_decoder_graph()
    model.graph.node.append(helper.make_node("GroupQueryAttention", ["hidden"], ["x"]))
    assert not load_model_spec(write_model_dir(tmp_path / "m", model)).uses_gqa


def test_logits_last_only_from_metadata_props(tmp_path: Path) -> None:
    model = make_decoder_graph(metadata={"genai.logits": "last"})
    assert load_model_spec(write_model_dir(tmp_path / "m", model)).logits_last_only


def test_spec_is_hashable(tmp_path: Path) -> None:
    spec = load_model_spec(write_model_dir(tmp_path / "m", genai_config=genai_config()))
    assert hash(spec) == hash(load_model_spec(tmp_path / "m"))


# --- fingerprint -----------------------------------------------------------------------


def test_fingerprint_stable_across_loads_and_copies(tmp_path: Path) -> None:
    a = write_model_dir(tmp_path / "a")
    b = write_model_dir(tmp_path / "b")
    assert load_model_spec(a).fingerprint == load_model_spec(a).fingerprint
    # Same graph bytes elsewhere: same model, same KV namespace.
    assert load_model_spec(a).fingerprint == load_model_spec(b).fingerprint


def test_fingerprint_changes_with_the_graph(tmp_path: Path) -> None:
    a = load_model_spec(write_model_dir(tmp_path / "a")).fingerprint
    b = load_model_spec(write_model_dir(tmp_path / "b", make_decoder_graph(num_layers=3)))
    c = load_model_spec(
        write_model_dir(tmp_path / "c", make_decoder_graph(metadata={"genai.logits": "last"}))
    )
    assert len({a, b.fingerprint, c.fingerprint}) == 3


def test_fingerprint_covers_external_data_sizes_not_bytes(tmp_path: Path) -> None:
    d = tmp_path / "ext"
    d.mkdir()
    onnx.save(
        make_decoder_graph(),
        str(d / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    write_word_tokenizer(d)
    data = d / "model.onnx.data"
    first = load_model_spec(d).fingerprint
    # The weights themselves are not hashed (they can be gigabytes) ...
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert load_model_spec(d).fingerprint == first
    # ... but their size is.
    data.write_bytes(bytes(raw) + b"\0" * 16)
    assert load_model_spec(d).fingerprint != first
    data.unlink()
    assert load_error(d) == "model.onnx.data: external data file named by model.onnx is missing"


# --- load errors -----------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    assert load_error(tmp_path / "nope") == f"model directory {tmp_path / 'nope'} does not exist"


def test_missing_model_file(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m")
    (d / "model.onnx").unlink()
    assert load_error(d) == f"{d / 'model.onnx'}: model file not found"


def test_missing_tokenizer(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", tokenizer=False)
    assert load_error(d) == f"{d / 'tokenizer.json'}: tokenizer file not found"


def test_not_an_onnx_file(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m")
    (d / "model.onnx").write_bytes(b"\xff\xfe not protobuf")
    assert load_error(d).startswith("model.onnx: not a valid ONNX model")


def test_missing_input_ids(tmp_path: Path) -> None:
    past, present = kv_io()
    d = write_model_dir(tmp_path / "m", make_io_graph(past, [LOGITS, *present]))
    assert load_error(d) == "model.onnx: graph has no input 'input_ids'"


def test_missing_logits(tmp_path: Path) -> None:
    past, present = kv_io()
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], present))
    assert load_error(d) == "model.onnx: graph has no output 'logits'"


@pytest.mark.parametrize("name", ["input_ids", "attention_mask", "position_ids"])
def test_int_inputs_must_be_int64(tmp_path: Path, name: str) -> None:
    past, present = kv_io()
    ints = [(n, TensorProto.INT64, ("batch", "seq")) for n in ("input_ids", "attention_mask")]
    ints.append(("position_ids", TensorProto.INT64, ("batch", "seq")))
    ints = [(n, TensorProto.INT32 if n == name else t, s) for n, t, s in ints]
    d = write_model_dir(tmp_path / "m", make_io_graph([*ints, *past], [LOGITS, *present]))
    assert load_error(d) == f"{name}: must be int64, got int32"


def test_unsupported_input(tmp_path: Path) -> None:
    past, present = kv_io()
    extra = ("token_type_ids", TensorProto.INT64, ("batch", "seq"))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, extra, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "model.onnx: unsupported graph input 'token_type_ids' (the engine feeds input_ids, "
        "attention_mask, position_ids, past_key_values.%d.key, past_key_values.%d.value)"
    )


def test_no_kv_cache(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS], [LOGITS]))
    assert load_error(d) == (
        "model.onnx: graph has no KV-cache inputs ('past_key_values.0.key'); "
        "the engine needs a decoder with past/present KV"
    )


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("present.3.value", "unpaired KV: past_key_values.3.value has no present.3.value"),
        ("past_key_values.1.key", "unpaired KV: present.1.key has no past_key_values.1.key"),
        ("present.0.key", "unpaired KV: past_key_values.0.key has no present.0.key"),
        ("past_key_values.2.value", "unpaired KV: present.2.value has no past_key_values.2.value"),
    ],
)
def test_unpaired_kv(tmp_path: Path, drop: str, message: str) -> None:
    past, present = kv_io(layers=range(4))
    past = [t for t in past if t[0] != drop]
    present = [t for t in present if t[0] != drop]
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == message


def test_key_without_value(tmp_path: Path) -> None:
    past, present = kv_io(layers=range(2))
    past = [t for t in past if t[0] != "past_key_values.1.value"]
    present = [t for t in present if t[0] != "present.1.value"]
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == "unpaired KV: past_key_values.1.key has no past_key_values.1.value"


def test_layers_not_contiguous(tmp_path: Path) -> None:
    past, present = kv_io(layers=(0, 1, 3))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "KV layer indices are not contiguous from 0: have 0, 1, 3; past_key_values.2.key is missing"
    )


def test_layers_not_starting_at_zero(tmp_path: Path) -> None:
    past, present = kv_io(layers=(1, 2))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "KV layer indices are not contiguous from 0: have 1, 2; past_key_values.0.key is missing"
    )


def test_kv_dtype_mismatch(tmp_path: Path) -> None:
    past, present = kv_io()
    past = [
        (n, TensorProto.FLOAT16 if n == "past_key_values.1.value" else t, s) for n, t, s in past
    ]
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "KV dtype mismatch: past_key_values.0.key is float32 but past_key_values.1.value is float16"
    )


def test_kv_dtype_mismatch_between_past_and_present(tmp_path: Path) -> None:
    past, _ = kv_io()
    _, present = kv_io(dtype=TensorProto.FLOAT16)
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "KV dtype mismatch: past_key_values.0.key is float32 but present.0.key is float16"
    )


def test_kv_dtype_unsupported(tmp_path: Path) -> None:
    past, present = kv_io(dtype=TensorProto.BFLOAT16)
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "past_key_values.0.key: KV dtype bfloat16 is not supported (float32 or float16)"
    )


def test_kv_rank_not_4(tmp_path: Path) -> None:
    past, present = kv_io(shape=("batch", 2, "past"))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "past_key_values.0.key: KV rank 3, expected 4 [batch, kv_heads, seq, head_dim]"
    )


def test_kv_heads_unknown(tmp_path: Path) -> None:
    past, present = kv_io(shape=("batch", "kv_heads", "past", 4))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "past_key_values.0.key: dim 1 (kv_heads) is not static and no config gives "
        "num_key_value_heads"
    )


def test_head_dim_unknown(tmp_path: Path) -> None:
    past, present = kv_io(shape=("batch", 2, "past", "head_dim"))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "past_key_values.0.key: dim 3 (head_dim) is not static and no config gives head_size"
    )


def test_kv_shape_mismatch_across_layers(tmp_path: Path) -> None:
    past, present = kv_io()
    past = [(n, t, ("batch", 2, "past", 8) if "1." in n else s) for n, t, s in past]
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [LOGITS, *present]))
    assert load_error(d) == (
        "KV shape mismatch: past_key_values.0.key has head_dim 4 but past_key_values.1.key has 8"
    )


def test_logits_rank(tmp_path: Path) -> None:
    past, present = kv_io()
    logits = ("logits", TensorProto.FLOAT, ("batch", VOCAB_SIZE))
    d = write_model_dir(tmp_path / "m", make_io_graph([IDS, *past], [logits, *present]))
    assert load_error(d) == "logits: rank 2, expected 3 [batch, seq, vocab]"


def test_bad_config_values(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", genai_config=genai_config(eos_token_id="</s>"))
    assert load_error(d) == (
        "eos_token_id: expected an integer or a list of integers in the model config, got '</s>'"
    )
    (d / "genai_config.json").write_text("{not json")
    assert load_error(d).startswith("genai_config.json: cannot read (")


def test_the_constraint_checker_imports_no_onnx() -> None:
    """The checker process is handed a ModelSpec and never parses a graph, so
    it must not load the onnx package (~17 MB of its RSS): model_dir.py and
    rope.py import onnx only where they parse one."""
    code = (
        "import sys\n"
        "import genai_service.guidance.constraint_check\n"
        "import genai_service.model.model_dir\n"
        "print('onnx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
