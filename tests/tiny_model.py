"""Tiny deterministic decoder-only ONNX models for tests.

`build_tiny_model(dir, spec)` writes a complete model directory (docs/design.md, "Model directory"): `model.onnx`
with the past/present I/O contract, a word-level `tokenizer.json`, the chosen config file and
`tokenizer_config.json` with a chat template. Weights come from `numpy.random.default_rng(seed)`,
so the same spec always gives a byte-identical model.

Architecture (llama-like): embedding → per layer [RMSNorm → attention (RoPE or learned
positions, GQA with KV heads repeated to query heads) → residual → RMSNorm → SwiGLU MLP →
residual] → final RMSNorm → LM head.

`reference_logits` / `reference_greedy` recompute the whole sequence every time (no KV reuse);
they are the ground truth that KV-cached engine paths are compared against. `make_feed` /
`run_model` run single forwards (cached single-threaded CPU sessions) for hand-made KV tests.

`attention="gqa"` uses com.microsoft.GroupQueryAttention: RIGHT-padded past (valid KV first in
each row), seqlens_k = sum(attention_mask) - 1, rotary inside the op (no position_ids input).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import yaml
from onnx import TensorProto, helper, numpy_helper
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE, WordLevel

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_ID = 0
PAD_ID = 0  # padding reuses <unk>; padded positions are masked anyway
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS: list[str] = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]

# fmt: off
_PLAIN_WORDS = [
    "the", "a", "an", "cat", "dog", "bird", "fish", "sat", "ran", "saw", "ate", "on", "in",
    "under", "over", "mat", "hat", "box", "tree", "house", "is", "was", "are", "be", "and", "or",
    "but", "not", "no", "yes", "to", "of", "with", "it", "he", "she", "they", "we", "you", "i",
    "this", "that", "here", "there", "big", "small", "red", "blue", "green", "good", "bad", "old",
    "new", "one", "two", "three", "hello", "world", "user", "assistant", "system", "what", "who",
    "where", "why", "how", "time", "day", "am", "now", "my", "your", "can", "go", "see", "like",
    ".", ",", "!", "?", ":", "'",
]
# fmt: on

# The whole vocabulary indexed by token id: WORDS[i] is the token with id i.
# ids 0..2 are the special tokens, plain words start at id 3.
WORDS: list[str] = SPECIAL_TOKENS + _PLAIN_WORDS
VOCAB_SIZE: int = len(WORDS)
WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(WORDS)}

# Fill-in-the-middle tokens of a TinyModelSpec(fim=True) model, after WORDS.
FIM_TOKENS: list[str] = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
FIM_IDS: dict[str, int] = {t: VOCAB_SIZE + i for i, t in enumerate(FIM_TOKENS)}

# The "bytes" tokenizer (TinyModelSpec.tokenizer): the same three special
# tokens, then token 3 + b for byte b (byte-level BPE without merges), so any
# text round-trips and llguidance can read it.
BYTE_VOCAB_SIZE: int = len(SPECIAL_TOKENS) + 256


def _byte_chars() -> list[str]:
    """The character byte-level BPE spells byte b with, indexed by b: printable
    Latin-1 bytes stand for themselves, the others for code points from 256 up."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


OPSET = 17
MS_DOMAIN = "com.microsoft"
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
MASK_MIN = -1e9  # finite "minus infinity": a fully masked (padding) row stays NaN-free

# ChatML-like, but only vocabulary words, so a rendered conversation has no <unk>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s> {{ message['role'] }} : {{ message['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and flavour of a tiny model. Same spec (incl. seed) ⇒ byte-identical files."""

    num_layers: int = 2
    hidden: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA: kv heads repeated to query heads
    head_dim: int = 8  # hidden == num_heads * head_dim
    max_seq_len: int = 128  # context length in the config; size of the position tables
    positions: str = "rope"  # "rope" | "learned"
    # "standard" (plain ONNX ops) | "gqa" (com.microsoft) | "static_cache" (onnx-genai's
    # static-cache ABI, as Mobius --static-cache exports it: TensorScatter + Attention-24)
    attention: str = "standard"
    config: str = "genai_config"  # "genai_config" | "inference_metadata" | "none"
    seed: int = 0
    weight_scale: float = 0.3  # std of projection weights; large enough for varied greedy text
    chat_template: bool = True  # write tokenizer_config.json with CHAT_TEMPLATE
    intermediate: int = 64  # SwiGLU inner size
    add_bos: bool = False  # tokenizer.json post-processor prepends <s> when add_special_tokens
    tokenizer: str = "words"  # "words" (WORDS, WordLevel) | "bytes" (one token per byte)
    fim: bool = False  # "words" only: FIM_TOKENS as special tokens after WORDS

    @property
    def vocab_size(self) -> int:
        base = VOCAB_SIZE if self.tokenizer == "words" else BYTE_VOCAB_SIZE
        return base + (len(FIM_TOKENS) if self.fim else 0)

    def __post_init__(self) -> None:
        if self.hidden != self.num_heads * self.head_dim:
            raise ValueError(
                f"hidden={self.hidden} must equal num_heads*head_dim="
                f"{self.num_heads * self.head_dim}"
            )
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.positions not in ("rope", "learned"):
            raise ValueError(f"positions={self.positions!r}, allowed: 'rope', 'learned'")
        if self.attention not in ("standard", "gqa", "static_cache"):
            raise ValueError(
                f"attention={self.attention!r}, allowed: 'standard', 'gqa', 'static_cache'"
            )
        if self.attention == "static_cache" and (
            self.positions != "rope" or self.config != "inference_metadata"
        ):
            raise ValueError("attention='static_cache' needs rope and inference_metadata")
        if self.config not in ("genai_config", "inference_metadata", "none"):
            raise ValueError(
                f"config={self.config!r}, allowed: 'genai_config', 'inference_metadata', 'none'"
            )
        if self.attention == "gqa" and self.positions == "rope" and self.head_dim % 16:
            # ORT's CPU GroupQueryAttention rotary kernel requires it; use GQA_SPEC.
            raise ValueError(
                f"head_dim={self.head_dim}: attention='gqa' with rope needs a multiple of 16"
            )
        if self.tokenizer not in ("words", "bytes"):
            raise ValueError(f"tokenizer={self.tokenizer!r}, allowed: 'words', 'bytes'")
        if self.fim and self.tokenizer != "words":
            raise ValueError("fim=True needs tokenizer='words'")
        if self.num_layers < 1 or self.max_seq_len < 2:
            raise ValueError("num_layers must be >= 1 and max_seq_len >= 2")


# GroupQueryAttention variant (4 query heads sharing 2 KV heads, head_dim 16 as ORT's rotary
# kernel needs); `dataclasses.replace(GQA_SPEC, attention="standard")` is its plain-ops twin
# with the same weights and the same logits.
GQA_SPEC = TinyModelSpec(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, attention="gqa")


# ---------------------------------------------------------------------------------------------
# tokenizer helpers


def encode_words(text: str) -> list[int]:
    """Whitespace split → ids (unknown words → <unk>); no bos."""
    return [WORD_TO_ID.get(w, UNK_ID) for w in text.split()]


def decode_ids(ids: list[int]) -> str:
    """ids → words joined by single spaces, special tokens skipped (like tokenizer.decode)."""
    return " ".join(WORDS[i] for i in ids if i >= len(SPECIAL_TOKENS))


def encode_bytes(text: str) -> list[int]:
    """Token ids of ``text`` under the "bytes" tokenizer: one per UTF-8 byte."""
    return [len(SPECIAL_TOKENS) + b for b in text.encode()]


def _tokenizer_json(add_bos: bool, kind: str = "words", fim: bool = False) -> str:
    if kind == "bytes":
        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(_byte_chars())})
        tok = Tokenizer(BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    else:
        vocab = dict(WORD_TO_ID)
        if fim:
            vocab.update({t: FIM_IDS[t] for t in FIM_TOKENS})
        tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # "words" has no decoder: tokenizers then joins decoded tokens with single spaces.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if fim:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM_TOKENS])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A $B",
            special_tokens=[(BOS_TOKEN, BOS_ID)],
        )
    return tok.to_str(pretty=True)


# ---------------------------------------------------------------------------------------------
# weights


def _weights(spec: TinyModelSpec) -> dict[str, np.ndarray]:
    """All weights, drawn in a fixed order independent of `positions`/`attention`, so every
    variant with the same seed shares the same parameters."""
    rng = np.random.default_rng(spec.seed)
    h, d, s = spec.hidden, spec.head_dim, spec.weight_scale

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * s).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "embed": rng.standard_normal((spec.vocab_size, h)).astype(np.float32),
        "pos_embed": (rng.standard_normal((spec.max_seq_len, h)) * 0.5).astype(np.float32),
    }
    for i in range(spec.num_layers):
        w[f"l{i}.attn_norm"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[f"l{i}.wq"] = mat(h, spec.num_heads * d)
        w[f"l{i}.wk"] = mat(h, spec.num_kv_heads * d)
        w[f"l{i}.wv"] = mat(h, spec.num_kv_heads * d)
        w[f"l{i}.wo"] = mat(spec.num_heads * d, h)
        w[f"l{i}.mlp_norm"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[f"l{i}.w_gate"] = mat(h, spec.intermediate)
        w[f"l{i}.w_up"] = mat(h, spec.intermediate)
        w[f"l{i}.w_down"] = mat(spec.intermediate, h)
    w["final_norm"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    w["lm_head"] = mat(h, spec.vocab_size)
    # <unk> and <s> get logit exactly 0, far below the top word: greedy never emits them.
    w["lm_head"][:, [UNK_ID, BOS_ID]] = 0.0
    # RoPE tables, rotate-half convention: angle[p, i] = p * theta^(-2i/d), i < d/2.
    inv_freq = ROPE_THETA ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.outer(np.arange(spec.max_seq_len, dtype=np.float64), inv_freq)
    w["cos_cache"] = np.cos(angles).astype(np.float32)  # [max_seq_len, head_dim/2]
    w["sin_cache"] = np.sin(angles).astype(np.float32)
    return w


# ---------------------------------------------------------------------------------------------
# graph


class _Graph:
    """Minimal node builder with deterministic names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._n = 0

    def op(
        self,
        op_type: str,
        inputs: list[str],
        n_out: int = 1,
        outputs: list[str] | None = None,
        domain: str = "",
        **kw: Any,
    ) -> list[str]:
        self._n += 1
        name = f"{op_type}_{self._n}"
        outs = outputs or [f"{name}_out{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain, **kw))
        return outs

    def one(self, op_type: str, inputs: list[str], **kw: Any) -> str:
        return self.op(op_type, inputs, **kw)[0]

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def const_i64(self, name: str, values: list[int] | int) -> str:
        return self.init(name, np.array(values, dtype=np.int64))

    def const_f32(self, name: str, value: float) -> str:
        return self.init(name, np.array(value, dtype=np.float32))


def _rms_norm(g: _Graph, x: str, weight: str, axes: str | None = None) -> str:
    """``axes``: the name of a [-1] constant, for opset 18+ (ReduceMean takes axes as an input)."""
    sq = g.one("Mul", [x, x])
    if axes is None:
        mean = g.one("ReduceMean", [sq], axes=[-1], keepdims=1)
    else:
        mean = g.one("ReduceMean", [sq, axes], keepdims=1)
    inv = g.one("Reciprocal", [g.one("Sqrt", [g.one("Add", [mean, "c_eps"])])])
    return g.one("Mul", [g.one("Mul", [x, inv]), weight])


def _heads(g: _Graph, x: str, shape: str) -> str:
    """[B, S, n*hd] → [B, n, S, hd]; `shape` is the constant [0, 0, n, hd]."""
    return g.one("Transpose", [g.one("Reshape", [x, shape])], perm=[0, 2, 1, 3])


def _rope(g: _Graph, x: str, cos: str, sin: str) -> str:
    """x*cos + rotate_half(x)*sin; x [B, n, S, hd], cos/sin [B, 1, S, hd]."""
    x1, x2 = g.op("Split", [x], n_out=2, axis=-1)
    rot = g.one("Concat", [g.one("Neg", [x2]), x1], axis=-1)
    return g.one("Add", [g.one("Mul", [x, cos]), g.one("Mul", [rot, sin])])


def _standard_attention(
    g: _Graph, spec: TinyModelSpec, i: int, x: str, mask: str, cos: str | None, sin: str | None
) -> str:
    q = _heads(g, g.one("MatMul", [x, f"l{i}.wq"]), "c_shape_q")  # [B, nh, S, d]
    k = _heads(g, g.one("MatMul", [x, f"l{i}.wk"]), "c_shape_kv")  # [B, nkv, S, d]
    v = _heads(g, g.one("MatMul", [x, f"l{i}.wv"]), "c_shape_kv")
    if cos is not None and sin is not None:
        q = _rope(g, q, cos, sin)
        k = _rope(g, k, cos, sin)
    # present = past ‖ new along the sequence axis: [B, nkv, T, d]
    g.op("Concat", [f"past_key_values.{i}.key", k], outputs=[f"present.{i}.key"], axis=2)
    g.op("Concat", [f"past_key_values.{i}.value", v], outputs=[f"present.{i}.value"], axis=2)

    def repeat_kv(t: str) -> str:  # [B, nkv, T, d] → [B, nh, T, d]; head h uses kv head h // rep
        t5 = g.one("Unsqueeze", [t, "c_axis2"])  # [B, nkv, 1, T, d]
        t5 = g.one("Expand", [t5, "c_rep_shape"])  # [B, nkv, rep, T, d]
        return g.one("Reshape", [t5, "c_shape_all_heads"])

    k_all = repeat_kv(f"present.{i}.key")
    v_all = repeat_kv(f"present.{i}.value")
    scores = g.one("MatMul", [q, g.one("Transpose", [k_all], perm=[0, 1, 3, 2])])  # [B,nh,S,T]
    scores = g.one("Add", [g.one("Mul", [scores, "c_scale"]), mask])
    probs = g.one("Softmax", [scores], axis=-1)
    ctx = g.one("MatMul", [probs, v_all])  # [B, nh, S, d]
    ctx = g.one("Reshape", [g.one("Transpose", [ctx], perm=[0, 2, 1, 3]), "c_shape_hidden"])
    return g.one("MatMul", [ctx, f"l{i}.wo"])


def _gqa_attention(
    g: _Graph, spec: TinyModelSpec, i: int, x: str, seqlens_k: str, total_len: str
) -> str:
    rope = spec.positions == "rope"
    inputs = [
        g.one("MatMul", [x, f"l{i}.wq"]),  # [B, S, nh*d]
        g.one("MatMul", [x, f"l{i}.wk"]),  # [B, S, nkv*d]
        g.one("MatMul", [x, f"l{i}.wv"]),
        f"past_key_values.{i}.key",
        f"past_key_values.{i}.value",
        seqlens_k,
        total_len,
    ]
    if rope:
        inputs += ["cos_cache", "sin_cache"]
    out = g.op(
        "GroupQueryAttention",
        inputs,
        outputs=[f"attn_{i}", f"present.{i}.key", f"present.{i}.value"],
        domain=MS_DOMAIN,
        num_heads=spec.num_heads,
        kv_num_heads=spec.num_kv_heads,
        do_rotary=int(rope),
        rotary_interleaved=0,
        scale=1.0 / math.sqrt(spec.head_dim),
    )[0]  # [B, S, nh*d]
    return g.one("MatMul", [out, f"l{i}.wo"])


def _io(spec: TinyModelSpec) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """Graph inputs/outputs with the symbolic dims of docs/design.md, "Model directory"."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    vi = helper.make_tensor_value_info
    b, s, t = "batch_size", "sequence_length", "total_sequence_length"
    inputs = [vi("input_ids", i64, [b, s]), vi("attention_mask", i64, [b, t])]
    if not (spec.attention == "gqa" and spec.positions == "rope"):
        # GQA rotates internally (positions from seqlens_k): no position_ids input then
        inputs.append(vi("position_ids", i64, [b, s]))
    outputs = [vi("logits", f32, [b, s, spec.vocab_size])]
    kv, d = spec.num_kv_heads, spec.head_dim
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(
                vi(f"past_key_values.{i}.{kind}", f32, [b, kv, "past_sequence_length", d])
            )
            outputs.append(vi(f"present.{i}.{kind}", f32, [b, kv, t, d]))
    return inputs, outputs


def _build_graph(spec: TinyModelSpec) -> onnx.ModelProto:
    w = _weights(spec)
    g = _Graph()
    gqa = spec.attention == "gqa"
    rope = spec.positions == "rope"
    used = {k for k in w if k.startswith("l")} | {"embed", "final_norm", "lm_head"}
    used |= {"cos_cache", "sin_cache"} if rope else {"pos_embed"}
    for name in sorted(used):
        g.init(name, w[name])
    g.const_f32("c_eps", RMS_EPS)
    g.const_i64("c_zero", 0)
    g.const_i64("c_one", 1)
    g.const_i64("c_axis1", [1])
    g.const_i64("c_axis2", [2])

    inputs, outputs = _io(spec)

    x = g.one("Gather", ["embed", "input_ids"], axis=0)  # [B, S, H]
    if not rope:
        x = g.one("Add", [x, g.one("Gather", ["pos_embed", "position_ids"], axis=0)])

    if gqa:
        # seqlens_k = valid tokens - 1 per row (int32 [B]); total_sequence_length (int32 scalar)
        valid = g.one("ReduceSum", ["attention_mask", "c_axis1"], keepdims=0)  # [B]
        seqlens_k = g.one("Cast", [g.one("Sub", [valid, "c_one"])], to=TensorProto.INT32)
        t = g.one("Gather", [g.one("Shape", ["attention_mask"]), "c_one"], axis=0)
        total_len = g.one("Cast", [t], to=TensorProto.INT32)

        def attention(i: int, hn: str) -> str:
            return _gqa_attention(g, spec, i, hn, seqlens_k, total_len)
    else:
        g.const_i64("c_shape_q", [0, 0, spec.num_heads, spec.head_dim])
        g.const_i64("c_shape_kv", [0, 0, spec.num_kv_heads, spec.head_dim])
        g.const_i64("c_rep_shape", [1, 1, spec.num_heads // spec.num_kv_heads, 1, 1])
        g.const_i64("c_shape_all_heads", [0, spec.num_heads, -1, spec.head_dim])
        g.const_i64("c_shape_hidden", [0, 0, spec.num_heads * spec.head_dim])
        g.const_f32("c_scale", 1.0 / math.sqrt(spec.head_dim))
        cos = sin = None
        if rope:
            # cos/sin [B, S, d/2] gathered by position → [B, 1, S, d]
            c = g.one("Gather", ["cos_cache", "position_ids"], axis=0)
            s = g.one("Gather", ["sin_cache", "position_ids"], axis=0)
            cos = g.one("Unsqueeze", [g.one("Concat", [c, c], axis=-1), "c_axis1"])
            sin = g.one("Unsqueeze", [g.one("Concat", [s, s], axis=-1), "c_axis1"])
        mask = _mask(g)

        def attention(i: int, hn: str) -> str:
            return _standard_attention(g, spec, i, hn, mask, cos, sin)

    for i in range(spec.num_layers):
        x = g.one("Add", [x, attention(i, _rms_norm(g, x, f"l{i}.attn_norm"))])
        hn = _rms_norm(g, x, f"l{i}.mlp_norm")
        gate = g.one("MatMul", [hn, f"l{i}.w_gate"])
        up = g.one("MatMul", [hn, f"l{i}.w_up"])
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])  # SwiGLU
        x = g.one("Add", [x, g.one("MatMul", [act, f"l{i}.w_down"])])
    g.op("MatMul", [_rms_norm(g, x, "final_norm"), "lm_head"], outputs=["logits"])

    graph = helper.make_graph(g.nodes, "tiny_decoder", inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", OPSET)]
    if gqa:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="genai-grpc-tests")
    model.ir_version = 8
    return model


def _build_static_cache_graph(spec: TinyModelSpec) -> onnx.ModelProto:
    """The same decoder (same weights, so the same logits as the other variants)
    with onnx-genai's static-cache I/O, built the way Mobius's ``--static-cache``
    export is: per layer ``key_cache.{i}``/``value_cache.{i}`` ``[batch, max_len,
    kv_hidden]`` inputs, into which two ``TensorScatter`` (opset 24) write the new
    keys and values at ``write_indices [batch]`` (outputs
    ``updated_key_cache.{i}``/``updated_value_cache.{i}``), then the ONNX
    ``Attention`` op (opset 24) over the whole buffer with ``is_causal=1`` and
    ``nonpad_kv_seqlen [batch]``, the valid length after the write. Positions
    are ``write_indices + 0..S-1``; logits ``[batch, S, vocab]``."""
    w = _weights(spec)
    g = _Graph()
    for name in sorted({k for k in w if k.startswith("l")} | {"embed", "final_norm", "lm_head"}):
        g.init(name, w[name])
    g.init("cos_cache", w["cos_cache"])
    g.init("sin_cache", w["sin_cache"])
    g.const_f32("c_eps", RMS_EPS)
    g.const_i64("c_zero", 0)
    g.const_i64("c_one", 1)
    g.const_i64("c_axis1", [1])
    g.const_i64("c_last", [-1])
    g.const_i64("c_shape_q", [0, 0, spec.num_heads, spec.head_dim])
    g.const_i64("c_shape_kv", [0, 0, spec.num_kv_heads, spec.head_dim])
    g.const_i64("c_shape_q3", [0, 0, spec.num_heads * spec.head_dim])
    g.const_i64("c_shape_kv3", [0, 0, spec.num_kv_heads * spec.head_dim])
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    vi = helper.make_tensor_value_info
    b, s, cap = "batch_size", "sequence_length", "max_cache_len"
    kv_hidden = spec.num_kv_heads * spec.head_dim
    inputs = [
        vi("input_ids", i64, [b, s]),
        vi("write_indices", i64, [b]),
        vi("nonpad_kv_seqlen", i64, [b]),
    ]
    outputs = [vi("logits", f32, [b, s, spec.vocab_size])]
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(vi(f"{kind}_cache.{i}", f32, [b, cap, kv_hidden]))
            outputs.append(vi(f"updated_{kind}_cache.{i}", f32, [b, cap, kv_hidden]))

    # positions [B, S] = write_indices[:, None] + arange(S)
    n = g.one("Gather", [g.one("Shape", ["input_ids"]), "c_one"], axis=0)
    steps = g.one("Range", ["c_zero", n, "c_one"])
    positions = g.one("Add", [g.one("Unsqueeze", ["write_indices", "c_axis1"]), steps])
    c = g.one("Gather", ["cos_cache", positions], axis=0)  # [B, S, d/2]
    sn = g.one("Gather", ["sin_cache", positions], axis=0)
    cos = g.one("Unsqueeze", [g.one("Concat", [c, c], axis=-1), g.const_i64("c_axis2", [2])])
    sin = g.one("Unsqueeze", [g.one("Concat", [sn, sn], axis=-1), "c_axis2"])  # [B, S, 1, d]

    def rope_3d(t: str, heads: str, flat: str) -> str:
        """RoPE on [B, S, n*d] in [B, S, n, d] form, back to [B, S, n*d]."""
        t4 = g.one("Reshape", [t, heads])
        x1, x2 = g.op("Split", [t4], n_out=2, axis=-1, num_outputs=2)
        rot = g.one("Concat", [g.one("Neg", [x2]), x1], axis=-1)
        t4 = g.one("Add", [g.one("Mul", [t4, cos]), g.one("Mul", [rot, sin])])
        return g.one("Reshape", [t4, flat])

    x = g.one("Gather", ["embed", "input_ids"], axis=0)  # [B, S, H]
    for i in range(spec.num_layers):
        hn = _rms_norm(g, x, f"l{i}.attn_norm", "c_last")
        q = rope_3d(g.one("MatMul", [hn, f"l{i}.wq"]), "c_shape_q", "c_shape_q3")
        k = rope_3d(g.one("MatMul", [hn, f"l{i}.wk"]), "c_shape_kv", "c_shape_kv3")
        v = g.one("MatMul", [hn, f"l{i}.wv"])
        keys, values = f"updated_key_cache.{i}", f"updated_value_cache.{i}"
        g.op("TensorScatter", [f"key_cache.{i}", k, "write_indices"], outputs=[keys], axis=1)
        g.op("TensorScatter", [f"value_cache.{i}", v, "write_indices"], outputs=[values], axis=1)
        ctx = g.one(
            "Attention",
            [q, keys, values, "", "", "", "nonpad_kv_seqlen"],
            is_causal=1,
            q_num_heads=spec.num_heads,
            kv_num_heads=spec.num_kv_heads,
            scale=1.0 / math.sqrt(spec.head_dim),
        )  # [B, S, nh*d]
        x = g.one("Add", [x, g.one("MatMul", [ctx, f"l{i}.wo"])])
        hn = _rms_norm(g, x, f"l{i}.mlp_norm", "c_last")
        gate = g.one("MatMul", [hn, f"l{i}.w_gate"])
        up = g.one("MatMul", [hn, f"l{i}.w_up"])
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
        x = g.one("Add", [x, g.one("MatMul", [act, f"l{i}.w_down"])])
    g.op("MatMul", [_rms_norm(g, x, "final_norm", "c_last"), "lm_head"], outputs=["logits"])
    graph = helper.make_graph(g.nodes, "tiny_static_cache", inputs, outputs, initializer=g.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 24)], producer_name="genai-grpc-tests"
    )
    model.ir_version = 10
    return model


def _mask(g: _Graph) -> str:
    """Additive attention bias [B, 1, S, T]: key j visible to query i iff
    j <= past_len + i and attention_mask[b, j] == 1 (left padding safe)."""
    t = g.one("Gather", [g.one("Shape", ["attention_mask"]), "c_one"], axis=0)
    s = g.one("Gather", [g.one("Shape", ["input_ids"]), "c_one"], axis=0)
    past = g.one("Sub", [t, s])
    kpos = g.one("Range", ["c_zero", t, "c_one"])  # [T]
    qpos = g.one("Add", [g.one("Range", ["c_zero", s, "c_one"]), past])  # [S] absolute positions
    causal = g.one("LessOrEqual", [kpos, g.one("Unsqueeze", [qpos, "c_axis1"])])  # [S, T]
    keep = g.one("Cast", ["attention_mask"], to=TensorProto.BOOL)  # [B, T]
    keep = g.one("Unsqueeze", [keep, "c_axis1"])  # [B, 1, T]
    allowed = g.one("And", [causal, keep])  # [B, S, T]
    bias = g.one("Where", [allowed, g.const_f32("c_0f", 0.0), g.const_f32("c_min", MASK_MIN)])
    return g.one("Unsqueeze", [bias, "c_axis1"])  # [B, 1, S, T]


# ---------------------------------------------------------------------------------------------
# config files


def _genai_config(spec: TinyModelSpec) -> dict:
    gqa = spec.attention == "gqa"
    decoder_inputs = {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    if not (gqa and spec.positions == "rope"):
        decoder_inputs["position_ids"] = "position_ids"
    return {
        "model": {
            "bos_token_id": BOS_ID,
            "context_length": spec.max_seq_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": spec.head_dim,
                "hidden_size": spec.hidden,
                "inputs": decoder_inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": spec.num_heads,
                "num_hidden_layers": spec.num_layers,
                "num_key_value_heads": spec.num_kv_heads,
            },
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "type": "llama",
            "vocab_size": spec.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": spec.max_seq_len,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": gqa,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def _inference_metadata(spec: TinyModelSpec) -> dict:
    gqa = spec.attention == "gqa"
    meta: dict = {"schema_version": "1.0"}
    if gqa:
        meta["required_capabilities"] = ["grouped_query_attention"]
    meta["model"] = {
        "architecture": "llama",
        "max_sequence_length": spec.max_seq_len,
        "vocab_size": spec.vocab_size,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "attention": {
            "type": "group_query_attention" if gqa else "multi_head_attention",
            "num_attention_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
        },
        "position_encoding": spec.positions,
    }
    meta["kv_cache"] = {"native_dtype": "float32", "layout": "BNSH"}
    if spec.attention == "static_cache":
        # onnx-genai's declaration of the static-cache ABI (what Mobius writes)
        meta["model"]["attention"]["type"] = "multi_head_attention"
        meta["model"]["io"] = {
            "static_cache": {
                "write_indices_input": "write_indices",
                "kv_sequence_length_input": "nonpad_kv_seqlen",
                "key_cache_inputs": [f"key_cache.{i}" for i in range(spec.num_layers)],
                "value_cache_inputs": [f"value_cache.{i}" for i in range(spec.num_layers)],
                "key_cache_outputs": [f"updated_key_cache.{i}" for i in range(spec.num_layers)],
                "value_cache_outputs": [f"updated_value_cache.{i}" for i in range(spec.num_layers)],
            }
        }
        meta["kv_cache"] = {"native_dtype": "float32", "layout": "BSH"}
    meta["generation"] = {"do_sample": False, "temperature": 1.0}
    return meta


# ---------------------------------------------------------------------------------------------
# public API


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:  # noqa: B008
    """Write model.onnx, tokenizer.json, the chosen config file and (if `spec.chat_template`)
    tokenizer_config.json into `out_dir` (created if needed). Returns `out_dir` as a Path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = (
        _build_static_cache_graph(spec) if spec.attention == "static_cache" else _build_graph(spec)
    )
    (out / "model.onnx").write_bytes(model.SerializeToString(deterministic=True))
    tokenizer = _tokenizer_json(spec.add_bos, spec.tokenizer, spec.fim)
    (out / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    if spec.config == "genai_config":
        text = json.dumps(_genai_config(spec), indent=2) + "\n"
        (out / "genai_config.json").write_text(text, encoding="utf-8")
    elif spec.config == "inference_metadata":
        text = yaml.safe_dump(_inference_metadata(spec), sort_keys=False)
        (out / "inference_metadata.yaml").write_text(text, encoding="utf-8")
    if spec.chat_template:
        tok_cfg = {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": UNK_TOKEN,
            "unk_token": UNK_TOKEN,
            "add_bos_token": spec.add_bos,
            "model_max_length": spec.max_seq_len,
            "chat_template": CHAT_TEMPLATE,
        }
        text = json.dumps(tok_cfg, indent=2) + "\n"
        (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return out


@functools.lru_cache(maxsize=32)
def _session(model_path: str, mtime_ns: int, size: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])


def load_session(model_dir: str | Path) -> ort.InferenceSession:
    """A cached single-threaded CPU InferenceSession for `model_dir/model.onnx`
    (rebuilt when the file changes)."""
    path = (Path(model_dir) / "model.onnx").resolve()
    st = path.stat()
    return _session(str(path), st.st_mtime_ns, st.st_size)


def kv_shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) read from the graph's past inputs."""
    sess = load_session(model_dir)
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    _, heads, _, dim = past[0].shape
    return len(past) // 2, int(heads), int(dim)


def make_feed(
    model_dir: str | Path,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    past: list[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Feed dict for one forward. `past` is [k0, v0, k1, v1, ...] (None ⇒ empty past).
    Defaults: mask all ones over past+new, positions past_len..past_len+S-1. Positions index
    tables of `max_seq_len` rows, so give padding tokens a valid one (e.g. 0)."""
    sess = load_session(model_dir)
    names = {i.name for i in sess.get_inputs()}
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None, :]
    batch, seq = ids.shape
    n_layers, heads, dim = kv_shape(model_dir)
    if past is None:
        past = [np.zeros((batch, heads, 0, dim), np.float32)] * (2 * n_layers)
    past_len = past[0].shape[2]
    if attention_mask is None:
        attention_mask = np.ones((batch, past_len + seq), np.int64)
    if position_ids is None:
        position_ids = np.broadcast_to(np.arange(past_len, past_len + seq), (batch, seq))
    feed: dict[str, np.ndarray] = {
        "input_ids": ids,
        "attention_mask": np.asarray(attention_mask, dtype=np.int64),
    }
    if "position_ids" in names:
        feed["position_ids"] = np.ascontiguousarray(position_ids, dtype=np.int64)
    for layer in range(n_layers):
        feed[f"past_key_values.{layer}.key"] = past[2 * layer]
        feed[f"past_key_values.{layer}.value"] = past[2 * layer + 1]
    return feed


def run_model(
    model_dir: str | Path, feed: dict[str, np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run one forward; returns (logits [B, S, V], presents [k0, v0, k1, v1, ...])."""
    sess = load_session(model_dir)
    out_names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(out_names, sess.run(None, feed), strict=True))
    n_layers = sum(1 for n in out_names if n.startswith("present.")) // 2
    presents = [outs[f"present.{i}.{kind}"] for i in range(n_layers) for kind in ("key", "value")]
    return outs["logits"], presents


def reference_logits(model_dir: str | Path, token_ids: list[int]) -> np.ndarray:
    """[vocab] float32 logits of the last position, from a full recompute of the whole
    sequence with an empty (length-0) past."""
    if not token_ids:
        raise ValueError("token_ids must not be empty")
    logits, _ = run_model(model_dir, make_feed(model_dir, np.array([token_ids])))
    return logits[0, -1].copy()


def reference_greedy(
    model_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy generation by full recompute each step (no KV reuse). Returns only the new
    tokens; stops after emitting an id in `eos_ids` (that id is included)."""
    seq = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(np.argmax(reference_logits(model_dir, seq)))
        new.append(tok)
        seq.append(tok)
        if tok in eos_ids:
            break
    return new
