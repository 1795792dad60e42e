"""The ONNX graph of a decoder: Llama, Qwen2/3, Gemma 3 (docs/design.md, "Model directory").

Inputs ``input_ids`` ``[batch, seq]`` and ``attention_mask`` ``[batch, total_seq]``
(int64) and ``past_key_values.{i}.key/value`` ``[batch, kv_heads, past_seq, head_dim]``;
outputs ``logits`` and ``present.{i}.key/value``. Attention is
``com.microsoft.GroupQueryAttention`` with rotary embeddings inside it, so
there is no ``position_ids`` input: positions follow from ``attention_mask``
(``seqlens_k = sum(mask) - 1``) and the past length. With past and present
bound to the same buffer (``[batch, kv_heads, max_len, head_dim]``) the cache
is updated in place.

By default ``logits`` holds only the last position (``[batch, 1, vocab]``,
metadata ``genai.logits = "last"``): the last hidden state is sliced out before
the final norm and LM head, which saves a ``vocab x hidden`` matmul per prompt
token. The optional input ``num_logits_to_keep`` (int64 ``[1]``, an initializer
with the default 1, so callers that do not know it need not feed it) widens
that to the last N positions, ``[batch, N, vocab]``: speculative decoding
verifies N draft positions in one call. ``all_logits`` gives ``[batch, seq,
vocab]`` (``genai.logits = "all"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from genai_service.convert.gguf_model import QK, DecoderParams, GGUFModel
from genai_service.convert.weights import (
    DEFAULT_WEIGHTS,
    WEIGHT_FORMATS,
    Float32Linear,
    LinearPart,
    NBitsLinear,
    blocksum_matrix,
    make_linear,
    nbits_linear,
)
from genai_service.model.model_dir import NUM_LOGITS_TO_KEEP

OPSET = 21
MS_DOMAIN = "com.microsoft"
INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class GraphOptions:
    """How the graph is built."""

    weights: str = DEFAULT_WEIGHTS  # fp32 | int8 | int4 (see weights.py)
    all_logits: bool = False  # logits for every position instead of the last one
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fast), 1 = fp32 activations
    lm_head_accuracy_level: int | None = None  # None: same as accuracy_level
    max_positions: int | None = None  # rotary cache length; None: the context length

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights must be one of {', '.join(WEIGHT_FORMATS)}; got {self.weights!r}"
            )
        for level in (self.accuracy_level, self.lm_head_accuracy_level):
            if level is not None and level not in (0, 1, 2, 3, 4):
                raise ValueError(f"accuracy_level must be 0..4, got {level}")


class _Graph:
    """Accumulates nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def const(self, name: str, value: np.ndarray) -> str:
        if name in self._names:
            raise ValueError(f"duplicate initializer {name!r}")
        self._names.add(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        n_out: int = 1,
        domain: str = "",
        outputs: Sequence[str] | None = None,
        **attrs: Any,
    ) -> list[str]:
        outs = (
            list(outputs)
            if outputs is not None
            else [f"{name}/out{i}" if n_out > 1 else f"{name}/out" for i in range(n_out)]
        )
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outs, name=name, domain=domain, **attrs)
        )
        return outs


class _DecoderBuilder:
    def __init__(
        self,
        gguf: GGUFModel,
        params: DecoderParams,
        options: GraphOptions,
        progress: Callable[[str], None],
    ) -> None:
        self.gguf = gguf
        self.p = params
        self.opt = options
        self.g = _Graph()
        self.progress = progress
        self._extended: dict[tuple[str, int, int], str] = {}
        self._blocksum_matrices: set[str] = set()

    # -- building blocks -------------------------------------------------------------------

    def linear(
        self, x: str, parts: Sequence[LinearPart], name: str, accuracy_level: int | None = None
    ) -> str:
        """``x @ W.T`` for the rows of ``parts`` fused along the output dimension."""
        lin = make_linear(parts, self.opt.weights)
        return self._emit_linear(x, lin, name, accuracy_level)

    def _emit_linear(
        self, x: str, lin: Float32Linear | NBitsLinear, name: str, accuracy_level: int | None = None
    ) -> str:
        g = self.g
        if isinstance(lin, Float32Linear):
            w = g.const(f"{name}.weight", lin.w_t)
            return g.op("MatMul", [x, w], name)[0]
        level = self.opt.accuracy_level if accuracy_level is None else accuracy_level
        if lin.offset_blocks:
            x = self._with_blocksums(x, lin.input_k, lin.offset_blocks)
        inputs = [
            x,
            g.const(f"{name}.qweight", lin.packed),
            g.const(f"{name}.scales", lin.scales.reshape(-1)),
        ]
        if lin.zero_points is not None:
            inputs.append(g.const(f"{name}.zero_points", lin.zero_points.reshape(-1)))
        return g.op(
            "MatMulNBits",
            inputs,
            name,
            domain=MS_DOMAIN,
            K=lin.k,
            N=lin.n,
            bits=lin.bits,
            block_size=QK,
            accuracy_level=level,
        )[0]

    def _with_blocksums(self, x: str, k: int, offset_blocks: int) -> str:
        """``concat(x, x @ S)``: the input of a weight with folded block offsets."""
        key = (x, k, offset_blocks)
        if key not in self._extended:
            g = self.g
            s_name = f"blocksum_matrix.{k}.{offset_blocks}"
            if s_name not in self._blocksum_matrices:
                self._blocksum_matrices.add(g.const(s_name, blocksum_matrix(k, offset_blocks)))
            sums = g.op("MatMul", [x, s_name], f"{x}/blocksums")[0]  # [batch, seq, 32*e]
            self._extended[key] = g.op("Concat", [x, sums], f"{x}/with_blocksums", axis=-1)[0]
        return self._extended[key]

    def norm_weight(self, tensor: str) -> str:
        return self.g.const(tensor, self.gguf.tensor(tensor).dequantize())

    # -- the model ---------------------------------------------------------------------------

    def build(self) -> onnx.ModelProto:
        p, g = self.p, self.g
        # Shared by all layers: GroupQueryAttention's sequence bookkeeping.
        mask_sum = g.op(
            "ReduceSum",
            ["attention_mask", g.const("one_axis", np.array([1]))],
            "mask_sum",
            keepdims=0,
        )[0]
        seqlens = g.op(
            "Sub", [mask_sum, g.const("one_i64", np.array(1, dtype=np.int64))], "seqlens_minus_one"
        )[0]
        seqlens_k = g.op("Cast", [seqlens], "seqlens_k", to=TensorProto.INT32)[0]  # [batch]
        mask_shape = g.op("Shape", ["attention_mask"], "mask_shape")[0]
        total = g.op(
            "Gather",
            [mask_shape, g.const("index_one", np.array(1, dtype=np.int64))],
            "total_len_i64",
            axis=0,
        )[0]
        total_len = g.op("Cast", [total], "total_sequence_length", to=TensorProto.INT32)[0]
        rotary = {False: self.rotary_cache(p.rope_theta, "", scaled=True)}
        if any(p.is_local(i) for i in range(p.n_layers)) and p.rope_theta_local:
            rotary[True] = self.rotary_cache(p.rope_theta_local, "_local", scaled=False)
        else:
            rotary[True] = rotary[False]

        hidden, lm_head = self.embeddings()
        residual: str | None = None
        for i in range(p.n_layers):
            self.progress(f"layer {i}")
            cos, sin = rotary[p.is_local(i)]
            hidden, residual = self.layer(i, hidden, residual, seqlens_k, total_len, cos, sin)

        self.progress("lm head")
        if residual is None:
            raise ValueError("the model has no layers")
        if not self.opt.all_logits:
            # Only the last position (or the last num_logits_to_keep) feeds the
            # final norm and the LM head.
            keep = g.const(NUM_LOGITS_TO_KEEP, np.array([1], dtype=np.int64))
            starts = g.op("Neg", [keep], "last_start")[0]
            ends = g.const("last_end", np.array([INT64_MAX], dtype=np.int64))
            axes = g.const("seq_axis", np.array([1], dtype=np.int64))
            hidden = g.op("Slice", [hidden, starts, ends, axes], "last_hidden")[0]
            residual = g.op("Slice", [residual, starts, ends, axes], "last_residual")[0]
        normed = g.op(
            "SkipSimplifiedLayerNormalization",
            [hidden, residual, self.norm_weight("output_norm.weight")],
            "final_norm",
            domain=MS_DOMAIN,
            epsilon=p.rms_eps,
        )[0]
        lm_head(normed)
        return self.model()

    def rotary_cache(self, theta: float, suffix: str, scaled: bool) -> tuple[str, str]:
        """cos/sin tables ``[positions, rope_dim / 2]``; ``scaled``: with the
        file's RoPE scaling (the global layers; Gemma's local ones have none)."""
        p = self.p
        n_pos = self.opt.max_positions or p.context_length
        inv_freq = theta ** (-np.arange(0, p.rope_dim, 2, dtype=np.float64) / p.rope_dim)
        if scaled:
            inv_freq = inv_freq / p.rope_linear_factor
            if p.rope_freq_factors:  # llama.cpp: theta / freq_factors[i]
                values = self.gguf.tensor("rope_freqs.weight").dequantize()
                if values.size != inv_freq.size:
                    raise ValueError(
                        f"rope_freqs.weight has {values.size} values; rope_dim / 2 is "
                        f"{inv_freq.size}"
                    )
                inv_freq = inv_freq / values.reshape(-1).astype(np.float64)
        angles = np.outer(np.arange(n_pos, dtype=np.float64), inv_freq)  # [n_pos, rope_dim/2]
        return (
            self.g.const(f"cos_cache{suffix}", np.cos(angles).astype(np.float32)),
            self.g.const(f"sin_cache{suffix}", np.sin(angles).astype(np.float32)),
        )

    def scaled(self, hidden: str) -> str:
        """The embedding times ``embed_scale`` (Gemma: sqrt(hidden))."""
        if self.p.embed_scale == 1.0:
            return hidden
        scale = self.g.const("embed_tokens/scale", np.array(self.p.embed_scale, dtype=np.float32))
        return self.g.op("Mul", [hidden, scale], "embed_tokens/scaled")[0]

    def embeddings(self) -> tuple[str, Callable[[str], None]]:
        """The token embedding output and a function emitting the LM head."""
        g, p = self.g, self.p
        embd = self.gguf.tensor("token_embd.weight")
        tied = not self.gguf.has("output.weight")
        if self.opt.weights == "fp32":
            table = g.const("embed_tokens.weight", embd.dequantize())  # [vocab, hidden]
            hidden = self.scaled(g.op("Gather", [table, "input_ids"], "embed_tokens", axis=0)[0])

            def lm_head(x: str) -> None:
                if not tied:
                    self._logits(
                        self.linear(x, [LinearPart(self.gguf.tensor("output.weight"))], "lm_head")
                    )
                    return
                # Gemm with transB reuses the embedding table: no transposed copy.
                flat = g.op(
                    "Reshape",
                    [x, g.const("lm_head/flat_shape", np.array([-1, p.hidden], dtype=np.int64))],
                    "lm_head/flatten",
                )[0]
                y = g.op("Gemm", [flat, table], "lm_head", transB=1)[0]
                self._logits(y, rows_of=x)

            return hidden, lm_head

        # Quantised formats: one 8-bit copy of the table serves the lookup and the LM head.
        table8 = nbits_linear([LinearPart(embd)], 8)
        codes = g.const("embed_tokens.qweight", table8.packed)  # [vocab, hidden/32, 32]
        gather_inputs = [
            "embed_tokens.qweight",
            "input_ids",
            g.const("embed_tokens.gather_scales", table8.scales[..., None]),
        ]
        if table8.zero_points is not None:
            gather_inputs.append(
                g.const("embed_tokens.gather_zero_points", table8.zero_points[..., None])
            )
        blocks = g.op(
            "GatherBlockQuantized",
            gather_inputs,
            "embed_tokens/gather",
            domain=MS_DOMAIN,
            gather_axis=0,
            quantize_axis=2,
            block_size=QK,
            bits=8,
        )[0]  # [batch, seq, hidden/32, 32]
        hidden = g.op(
            "Reshape",
            [blocks, g.const("embed_tokens/shape", np.array([0, 0, p.hidden], dtype=np.int64))],
            "embed_tokens",
        )[0]
        hidden = self.scaled(hidden)

        def lm_head_q(x: str) -> None:
            level = self.opt.lm_head_accuracy_level
            if not tied:
                lin = nbits_linear([LinearPart(self.gguf.tensor("output.weight"))], 8)
                self._logits(self._emit_linear(x, lin, "lm_head", level))
                return
            level = self.opt.accuracy_level if level is None else level
            inputs = [x, codes, g.const("lm_head.scales", table8.scales.reshape(-1))]
            if table8.zero_points is not None:
                inputs.append(g.const("lm_head.zero_points", table8.zero_points.reshape(-1)))
            y = g.op(
                "MatMulNBits",
                inputs,
                "lm_head",
                domain=MS_DOMAIN,
                K=table8.k,
                N=table8.n,
                bits=8,
                block_size=QK,
                accuracy_level=level,
            )[0]
            self._logits(y)

        return hidden, lm_head_q

    def _logits(self, y: str, rows_of: str | None = None) -> None:
        """Emit the ``logits`` output from ``y``; ``rows_of``: when ``y`` is flat
        (``[batch * rows, vocab]``), the ``[batch, rows, hidden]`` LM head input
        whose leading dims it gets back."""
        g = self.g
        if rows_of is None:
            g.op("Identity", [y], "logits", outputs=["logits"])
            return
        lead = g.op(
            "Slice",
            [
                g.op("Shape", [rows_of], "logits/input_shape")[0],
                g.const("logits/lead_start", np.array([0], dtype=np.int64)),
                g.const("logits/lead_end", np.array([2], dtype=np.int64)),
            ],
            "logits/lead_dims",
        )[0]
        vocab = g.const("logits/vocab", np.array([self.p.vocab_size], dtype=np.int64))
        shape = g.op("Concat", [lead, vocab], "logits/shape", axis=0)[0]
        g.op("Reshape", [y, shape], "logits", outputs=["logits"])

    def layer(
        self,
        i: int,
        hidden: str,
        residual: str | None,
        seqlens_k: str,
        total_len: str,
        cos: str,
        sin: str,
    ) -> tuple[str, str]:
        """One decoder block; returns (block output, residual stream before it)."""
        g, p, t = self.g, self.p, self.gguf.tensor
        pre = f"layers.{i}"
        attn_norm = self.norm_weight(f"blk.{i}.attn_norm.weight")
        if residual is None:
            x = g.op(
                "SimplifiedLayerNormalization",
                [hidden, attn_norm],
                f"{pre}/attn_norm",
                axis=-1,
                epsilon=p.rms_eps,
                stash_type=1,
            )[0]
            residual = hidden
        else:
            x, _, _, residual = g.op(
                "SkipSimplifiedLayerNormalization",
                [hidden, residual, attn_norm],
                f"{pre}/attn_norm",
                n_out=4,
                domain=MS_DOMAIN,
                epsilon=p.rms_eps,
            )

        heads = (p.n_heads, p.n_kv_heads) if p.rope_permuted else (0, 0)
        qkv = self.linear(
            x,
            [
                LinearPart(t(f"blk.{i}.attn_q.weight"), heads[0]),
                LinearPart(t(f"blk.{i}.attn_k.weight"), heads[1]),
                LinearPart(t(f"blk.{i}.attn_v.weight")),
            ],
            f"{pre}/qkv_proj",
        )
        if p.qkv_bias:
            bias = np.concatenate(
                [t(f"blk.{i}.attn_{w}.bias").dequantize().reshape(-1) for w in "qkv"]
            )
            qkv = g.op("Add", [qkv, g.const(f"{pre}/qkv_proj.bias", bias)], f"{pre}/qkv_bias")[0]
        # Packed q|k|v: GroupQueryAttention splits it itself (key and value left empty).
        q_k_v = [qkv, "", ""]
        if p.qk_norm:
            q_k_v = self.qk_norm(i, qkv)
        inputs = [
            *q_k_v,
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            seqlens_k,
            total_len,
            cos,
            sin,
        ]
        attrs: dict[str, Any] = {}
        if p.is_local(i):
            attrs["local_window_size"] = p.window(i)
        attn = g.op(
            "GroupQueryAttention",
            inputs,
            f"{pre}/attn",
            domain=MS_DOMAIN,
            outputs=[f"{pre}/attn/out", f"present.{i}.key", f"present.{i}.value"],
            num_heads=p.n_heads,
            kv_num_heads=p.n_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=p.attn_scale,
            **attrs,
        )[0]
        attn_out = self.linear(
            attn, [LinearPart(t(f"blk.{i}.attn_output.weight"))], f"{pre}/o_proj"
        )
        if p.post_norms:
            attn_out = self.rms_norm(
                attn_out, f"blk.{i}.post_attention_norm.weight", f"{pre}/post_attn_norm"
            )

        x, _, _, residual = g.op(
            "SkipSimplifiedLayerNormalization",
            [attn_out, residual, self.norm_weight(f"blk.{i}.ffn_norm.weight")],
            f"{pre}/ffn_norm",
            n_out=4,
            domain=MS_DOMAIN,
            epsilon=p.rms_eps,
        )
        gate_up = self.linear(
            x,
            [LinearPart(t(f"blk.{i}.ffn_gate.weight")), LinearPart(t(f"blk.{i}.ffn_up.weight"))],
            f"{pre}/gate_up_proj",
        )
        split = g.const(f"{pre}/gate_up_split", np.array([p.ffn, p.ffn], dtype=np.int64))
        gate, up = g.op("Split", [gate_up, split], f"{pre}/gate_up_split", n_out=2, axis=-1)
        if p.activation == "gelu_tanh":
            act = g.op("Gelu", [gate], f"{pre}/act/gelu", approximate="tanh")[0]
        else:
            sig = g.op("Sigmoid", [gate], f"{pre}/act/sigmoid")[0]
            act = g.op("Mul", [gate, sig], f"{pre}/act/silu")[0]
        h = g.op("Mul", [act, up], f"{pre}/act/mul_up")[0]
        down = self.linear(h, [LinearPart(t(f"blk.{i}.ffn_down.weight"))], f"{pre}/down_proj")
        if p.post_norms:
            down = self.rms_norm(down, f"blk.{i}.post_ffw_norm.weight", f"{pre}/post_ffw_norm")
        return down, residual

    def qk_norm(self, i: int, qkv: str) -> list[str]:
        """q, k and v of the packed projection, q and k RMS-normalised per head
        (before RoPE, which the attention op applies). GroupQueryAttention's own
        ``q_norm_weight`` inputs run on CUDA and WebGPU only, so the norm is
        explicit: heads as the last axis' groups, one SimplifiedLayerNormalization."""
        g, p, pre = self.g, self.p, f"layers.{i}"
        sizes = np.array([p.n_heads, p.n_kv_heads, p.n_kv_heads], dtype=np.int64) * p.head_dim
        q, k, v = g.op(
            "Split", [qkv, g.const(f"{pre}/qkv_split", sizes)], f"{pre}/qkv_split", n_out=3, axis=-1
        )
        heads = g.const(f"{pre}/heads_shape", np.array([0, 0, -1, p.head_dim], dtype=np.int64))
        flat = g.const(f"{pre}/flat_shape", np.array([0, 0, -1], dtype=np.int64))
        out = []
        for name, x in (("q", q), ("k", k)):
            h = g.op("Reshape", [x, heads], f"{pre}/{name}_heads")[0]
            h = self.rms_norm(h, f"blk.{i}.attn_{name}_norm.weight", f"{pre}/{name}_norm")
            out.append(g.op("Reshape", [h, flat], f"{pre}/{name}_normed")[0])
        return [*out, v]

    def rms_norm(self, x: str, weight: str, name: str) -> str:
        return self.g.op(
            "SimplifiedLayerNormalization",
            [x, self.norm_weight(weight)],
            name,
            axis=-1,
            epsilon=self.p.rms_eps,
            stash_type=1,
        )[0]

    def model(self) -> onnx.ModelProto:
        p = self.p
        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        kv: list[str | int | None] = [
            "batch_size",
            p.n_kv_heads,
            "past_sequence_length",
            p.head_dim,
        ]
        present: list[str | int | None] = [
            "batch_size",
            p.n_kv_heads,
            "total_sequence_length",
            p.head_dim,
        ]
        inputs = [
            helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info(
                "attention_mask", i64, ["batch_size", "total_sequence_length"]
            ),
        ]
        if not self.opt.all_logits:  # an input with a default: its initializer
            inputs.append(helper.make_tensor_value_info(NUM_LOGITS_TO_KEEP, i64, [1]))
        outputs = [
            helper.make_tensor_value_info(
                "logits",
                f32,
                # A static 1 when last-only: onnxruntime-genai sizes its logits
                # buffer from this dim (it never feeds num_logits_to_keep).
                ["batch_size", "sequence_length" if self.opt.all_logits else 1, p.vocab_size],
            )
        ]
        for i in range(p.n_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, kv))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", f32, present))
        graph = helper.make_graph(self.g.nodes, p.arch, inputs, outputs, self.g.initializers)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        )
        model.ir_version = 10
        model.producer_name = "genai-grpc convert"
        helper.set_model_props(
            model,
            {
                "genai.logits": "all" if self.opt.all_logits else "last",
                "genai.weights": self.opt.weights,
                "genai.architecture": p.arch,
            },
        )
        return model


def build_decoder(
    gguf: GGUFModel, options: GraphOptions, progress: Callable[[str], None] | None = None
) -> onnx.ModelProto:
    """The decoder graph for a GGUF file of one of the supported architectures."""
    gguf.check_types()
    params = gguf.decoder_params()
    builder = _DecoderBuilder(gguf, params, options, progress or (lambda _msg: None))
    model = builder.build()
    unused = gguf.unused_tensors()
    if unused:  # tensors of a variant we do not build: refuse, never ignore
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ValueError(f"the converter does not understand the GGUF tensors {shown}")
    return model
