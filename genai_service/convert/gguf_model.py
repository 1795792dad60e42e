"""Read a GGUF file: metadata, architecture hyper-parameters and (de)quantised tensors.

Parsing is delegated to the ``gguf`` package (memory-mapped, no copies), and
so is dequantisation to float32: every type its ``gguf.quants`` decodes
(``SUPPORTED_TYPES``). Where a type's blocks map onto ONNX Runtime's
block-quantised operators without loss, the block contents (scales, mins,
integer codes) are also unpacked here with vectorised numpy, so the converter
can carry them over exactly (docs/models.md, "Tensor types"):

- ``Q8_0`` (34 bytes / 32): ``d: f16``, ``q: int8[32]``; ``x = d * q``.
- ``Q4_0`` (18 bytes / 32): ``d: f16``, ``qs: u8[16]``; ``x = d * (q - 8)``.
- ``Q4_1`` (20 bytes / 32): ``d: f16``, ``m: f16``, ``qs: u8[16]``; ``x = d * q + m``.
- ``Q5_0`` (22 bytes / 32): ``d: f16``, ``qh: u32`` (bit ``j``: element ``j``'s
  fifth bit), ``qs: u8[16]``; ``x = d * (q - 16)``.
- ``Q4_K`` (144 bytes / 256): ``d, dmin: f16``, ``scales: u8[12]`` (eight 6-bit
  scales and mins), ``qs: u8[128]``; element ``i`` of 32-element sub-block
  ``j`` is ``d * sc[j] * q - dmin * m[j]``, i.e. a Q4_1-style block of 32 with
  float scale ``d * sc[j]`` and minimum ``-dmin * m[j]``.

In the 32-element 4-bit formats byte ``j`` of ``qs`` holds element ``j`` in its
low nibble and element ``j + 16`` in its high nibble; in Q4_K each 64-element
pair of sub-blocks takes 32 bytes, the first sub-block in the low nibbles.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

QK = 32  # elements per block of the graph's block-quantised weights

FLOAT_TYPES = ("F32", "F16", "BF16")
# What gguf.quants dequantises (it raises NotImplementedError for Q8_1, Q8_K
# and the integer types, which no model file uses for weights).
QUANTIZED_TYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
)  # fmt: skip
SUPPORTED_TYPES = FLOAT_TYPES + QUANTIZED_TYPES
# Types whose blocks are unpacked into codes (the rest are dequantised only).
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K")

_BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2, "Q5_0": 6 + QK // 2}
QK_K = 256  # elements per K-quant super-block
_Q4_K_BYTES = 4 + 12 + QK_K // 2


class UnsupportedTensorType(ValueError):
    """A tensor uses a GGUF type the converter cannot decode."""

    def __init__(self, name: str, type_name: str) -> None:
        super().__init__(
            f"tensor {name!r} has GGUF type {type_name}, which the converter does not support "
            f"(supported: {', '.join(SUPPORTED_TYPES)}); re-quantise the GGUF with one of "
            "these types, e.g. `llama-quantize --allow-requantize IN OUT Q4_K_M`"
        )
        self.tensor_name = name
        self.type_name = type_name


@dataclass(frozen=True)
class BlockCodes:
    """The integer codes and per-block parameters of a block-quantised matrix.

    ``codes`` is ``[rows, n_blocks, 32]`` uint8 in element order; the value of
    element ``i`` of block ``b`` in row ``r`` is
    ``scale[r, b] * (codes[r, b, i] - offset) + minimum[r, b]`` (``minimum`` is
    zero for the symmetric types: Q8_0, Q4_0, Q5_0).
    """

    codes: npt.NDArray[np.uint8]  # [rows, n_blocks, 32]
    scale: npt.NDArray[np.float32]  # [rows, n_blocks]
    minimum: npt.NDArray[np.float32]  # [rows, n_blocks]
    offset: int  # subtracted from the codes: 8 (Q4_0), 16 (Q5_0), 128 (Q8_0 as unsigned), 0
    bits: int

    @property
    def symmetric(self) -> bool:
        return not np.any(self.minimum)


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the file: its type and its raw bytes (memory-mapped)."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order: a weight is [out_features, in_features]
    raw: np.ndarray  # as stored: float32/float16 values or uint8 blocks [rows, bytes]

    def dequantize(self) -> npt.NDArray[np.float32]:
        """The tensor as float32 in numpy order."""
        return dequantize(self.type_name, self.raw, self.shape, self.name)

    def block_codes(self) -> BlockCodes:
        """The block contents of a tensor of one of ``BLOCK_TYPES``, in blocks of 32."""
        if self.type_name not in BLOCK_TYPES:
            raise ValueError(f"tensor {self.name!r} ({self.type_name}) has no 32-element blocks")
        return unpack_blocks(self.type_name, _rows(self.raw, self.shape), self.name)


ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3")
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's value; newer files say it (rope.freq_base_swa)
GEMMA3_SLIDING_PATTERN = 6  # five local layers, then one global


@dataclass(frozen=True)
class DecoderParams:
    """Architecture values read from a file's ``{architecture}.*`` metadata.

    One decoder shape covers the supported families (docs/models.md, "What is
    supported"): Llama (llama.cpp permutes its Q/K rows), Qwen2 (q/k/v biases),
    Qwen3 (QK-norm) and Gemma 3 (QK-norm, norms after attention and MLP,
    GELU-tanh, a scaled embedding, local layers with their own RoPE base).
    """

    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    rms_eps: float
    context_length: int
    vocab_size: int
    attn_scale: float
    rope_permuted: bool = True  # llama.cpp stored Q/K rows interleaved for its RoPE kernel
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # a norm on the attention and on the MLP output (Gemma)
    activation: str = "silu"  # silu | gelu_tanh, on the gate of a gated MLP
    embed_scale: float = 1.0
    sliding_window: int = 0  # > 0: the local layers attend to this many positions
    sliding_pattern: int = 0  # layer i is global when (i + 1) % pattern == 0
    rope_theta_local: float = 0.0  # the local layers' RoPE base
    # RoPE scaling of the global layers: positions divided by this ("linear"),
    # and the per-frequency divisors of rope_freqs.weight (Llama 3.1's "llama3"
    # scaling, which llama.cpp's converter bakes into that tensor).
    rope_linear_factor: float = 1.0
    rope_freq_factors: bool = False

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        if self.sliding_window <= 0:
            return False
        return self.sliding_pattern <= 0 or (layer + 1) % self.sliding_pattern != 0

    def window(self, layer: int) -> int:
        """``layer``'s attention window in positions (0: the whole context)."""
        return self.sliding_window if self.is_local(layer) else 0

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> DecoderParams:
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"general.architecture is {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if f"{arch}.{key}" not in meta:
                raise ValueError(f"GGUF metadata lacks {arch}.{key!r}")
            return meta[f"{arch}.{key}"]

        def get(key: str, default: Any) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = int(get("attention.key_length", hidden // n_heads))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{arch}.attention.value_length differs from key_length")
        n_layers = int(need("block_count"))
        n_vocab = get("vocab_size", None)
        if n_vocab is None:
            n_vocab = len(meta.get("tokenizer.ggml.tokens") or [])
            if not n_vocab:
                raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens")
        scaling = get("rope.scaling.type", "none")
        linear_factor = 1.0
        if scaling == "linear":
            linear_factor = float(get("rope.scaling.factor", 1.0))
            if not linear_factor > 0:
                raise ValueError(f"{arch}.rope.scaling.factor {linear_factor} must be > 0")
        elif scaling != "none":
            raise ValueError(
                f"{arch}.rope.scaling.type {scaling!r} is not supported (supported: none, "
                "linear, and llama3's frequency factors in rope_freqs.weight)"
            )
        common: dict[str, Any] = dict(
            arch=arch,
            n_layers=n_layers,
            hidden=hidden,
            ffn=int(need("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            context_length=int(need("context_length")),
            vocab_size=int(n_vocab),
            attn_scale=float(1.0 / np.sqrt(head_dim)),
            rope_linear_factor=linear_factor,
            rope_freq_factors="rope_freqs.weight" in tensor_names,
        )
        if arch == "llama":
            params = cls(**common)
        elif arch == "qwen2":
            params = cls(**common, rope_permuted=False, qkv_bias=True)
        elif arch == "qwen3":
            params = cls(**common, rope_permuted=False, qk_norm=True)
        else:  # gemma3
            window = int(get("attention.sliding_window", 0))
            if n_layers == 62:  # the 27B scales by hidden / heads (query_pre_attn_scalar)
                common["attn_scale"] = float(1.0 / np.sqrt(hidden / n_heads))
            params = cls(
                **common,
                rope_permuted=False,
                qk_norm=True,
                post_norms=True,
                activation="gelu_tanh",
                embed_scale=float(np.sqrt(hidden)),
                sliding_window=window,
                sliding_pattern=GEMMA3_SLIDING_PATTERN,
                rope_theta_local=float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
            )
        if params.rope_dim != head_dim:
            raise ValueError(
                f"partial rotary embeddings (rope.dimension_count {params.rope_dim} != head_dim "
                f"{head_dim}) are not supported"
            )
        if n_heads % params.n_kv_heads:
            raise ValueError(f"head_count {n_heads} is not a multiple of head_count_kv")
        if params.rope_freq_factors and params.sliding_window:
            raise ValueError("rope_freqs.weight with sliding-window layers is not supported")
        return params


class GGUFModel:
    """A GGUF file opened read-only: ``metadata`` and ``tensor(name)``."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader  # deferred: only conversion needs it

        self.path = Path(path)
        reader = GGUFReader(str(self.path), "r")
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self._tensors: dict[str, TensorRef] = {}
        for t in reader.tensors:
            # GGUF lists dimensions innermost first; numpy order is the reverse.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self._tensors[t.name] = TensorRef(t.name, t.tensor_type.name, shape, t.data)
        self._used: set[str] = set()

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> TensorRef:
        self._used.add(name)
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"GGUF file {self.path.name} has no tensor {name!r}") from None

    def decoder_params(self) -> DecoderParams:
        return DecoderParams.from_metadata(self.metadata, set(self._tensors))

    def unused_tensors(self) -> list[str]:
        """Tensors never read through :meth:`tensor` (after building: not understood)."""
        return [name for name in self._tensors if name not in self._used]

    def check_types(self) -> None:
        """Raise :class:`UnsupportedTensorType` for the first tensor we cannot decode."""
        for ref in self._tensors.values():
            if ref.type_name not in SUPPORTED_TYPES:
                raise UnsupportedTensorType(ref.name, ref.type_name)


def _rows(raw: np.ndarray, shape: tuple[int, ...]) -> npt.NDArray[np.uint8]:
    """Raw block bytes as ``[rows, bytes_per_row]`` uint8."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return np.asarray(raw, dtype=np.uint8).reshape(rows, -1)


def unpack_blocks(type_name: str, data: np.ndarray, name: str = "?") -> BlockCodes:
    """Decode ``[rows, bytes]`` uint8 into codes and parameters of 32-element blocks."""
    if type_name == "Q4_K":
        return _unpack_q4_k(data)
    if type_name not in _BLOCK_BYTES:
        raise UnsupportedTensorType(name, type_name)
    nbytes = _BLOCK_BYTES[type_name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, nbytes)
    d = _f16(blocks[..., 0:2])
    if type_name == "Q8_0":
        signed = blocks[..., 2:].view(np.int8)
        codes = (signed.astype(np.int16) + 128).astype(np.uint8)
        return BlockCodes(codes, d, np.zeros_like(d), offset=128, bits=8)
    if type_name == "Q5_0":
        high = blocks[..., 2:6].copy().view("<u4")  # [rows, nb, 1]
        fifth = ((high >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = blocks[..., 6:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (fifth << 4)
        return BlockCodes(codes, d, np.zeros_like(d), offset=16, bits=5)
    if type_name == "Q4_0":
        qs, minimum, offset = blocks[..., 2:], np.zeros_like(d), 8
    else:  # Q4_1
        minimum = _f16(blocks[..., 2:4])
        qs, offset = blocks[..., 4:], 0
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # low nibbles: 0..15, high: 16..31
    return BlockCodes(codes, d, minimum, offset=offset, bits=4)


def _f16(two_bytes: np.ndarray) -> npt.NDArray[np.float32]:
    """``[..., 2]`` uint8 little-endian halves as float32 ``[...]``."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _unpack_q4_k(data: np.ndarray) -> BlockCodes:
    """Q4_K super-blocks as eight Q4_1-style blocks of 32 each."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, _Q4_K_BYTES)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc_bytes, qs = blocks[..., 4:16], blocks[..., 16:]
    # The 6-bit scales and mins of sub-blocks 0..3 are the low six bits of
    # bytes 0..3 and 4..7; those of 4..7 take their low four bits from the
    # nibbles of bytes 8..11 and their top two from the top bits of 0..3, 4..7.
    lo, mid, hi = sc_bytes[..., 0:4], sc_bytes[..., 4:8], sc_bytes[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)  # [rows, n, 8]
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    pairs = qs.reshape(rows, -1, 4, QK)  # 4 pairs of sub-blocks, 32 bytes each
    codes = np.stack([pairs & 0x0F, pairs >> 4], axis=3).reshape(rows, -1, QK)  # [rows, n*8, 32]
    scale = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)
    return BlockCodes(codes, scale, minimum, offset=0, bits=4)


def dequantize(
    type_name: str, raw: np.ndarray, shape: tuple[int, ...], name: str = "?"
) -> npt.NDArray[np.float32]:
    """Any supported tensor as float32 of ``shape`` (the ``gguf`` package's decoding)."""
    if type_name == "F32":
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    if type_name == "F16":
        return np.asarray(raw, dtype=np.float16).astype(np.float32).reshape(shape)
    if type_name not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(name, type_name)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(np.asarray(raw), GGMLQuantizationType[type_name])
    return np.asarray(values, dtype=np.float32).reshape(shape)
