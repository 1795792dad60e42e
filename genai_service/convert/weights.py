"""Linear-layer weights for ONNX: row un-permutation, fusion and the three formats.

- ``fp32``: dequantised float32, stored transposed (``[K, N]``) for ``MatMul``.
- ``int8``: ``com.microsoft.MatMulNBits`` with 8-bit blocks of 32. Symmetric
  blocks (Q8_0, Q4_0, Q5_0: ``x = d * (q - offset)``) are carried over exactly
  (codes ``q - offset + 128``, default zero point 128); anything else is
  dequantised (the ``gguf`` package's decoding) and re-quantised per block with
  min/max (which reproduces Q4_1/Q4_K blocks almost exactly: the codes become
  ``17 * q`` and only the zero point is rounded; 5- and 6-bit codes keep
  about 1/500 of a block's range).
- ``int4``: ``MatMulNBits`` with 4-bit blocks of 32 and the *default* zero point 8,
  so ONNX Runtime's fast integer kernel applies (a float zero point ``-m/d`` is
  exact but takes a ~50x slower kernel; rounding it to an integer is badly
  lossy). A Q4_1 block ``x = d*q + m`` is written as ``d*(q - 8) + c`` with the
  per-block offset ``c = 8d + m``. The offset term of an output is
  ``sum_b c[n, b] * blocksum_b(activation)``; it is folded into the same
  ``MatMulNBits`` by appending the activation's block sums to its input
  (``concat(x, x @ S)``, ``S`` a 0/1 ``[K, 32*e]`` matrix) and ``c`` as extra
  4-bit weight blocks: a coarse piece plus a residual piece, which keeps the
  offset to ~1/200 of its range (measured: same KL vs fp32 as an exact float
  correction) at the cost of one tiny MatMul and a Concat per projection.
  Q4_0 blocks need no offset; Q4_1 and Q4_K blocks (float scale and minimum
  per 32 elements) are carried over exactly this way; every other source is
  re-quantised to Q4_1-style blocks (min/max, exact float minimum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from genai_service.convert.gguf_model import QK, TensorRef

WEIGHT_FORMATS = ("fp32", "int8", "int4")
# Chosen by measurement (docs/models.md): the fastest format within the quality bar.
DEFAULT_WEIGHTS = "int8"

# Carried over without loss: 4-bit codes with a float scale (and minimum) per 32
# elements into int4; symmetric blocks of up to 8 bits into int8.
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
SYMMETRIC_TYPES = ("Q8_0", "Q4_0", "Q5_0")

# 4-bit pieces encoding the per-block offsets (coarse + residual): error <= range/196.
OFFSET_PIECES = 2

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Float32Linear:
    """``y = x @ w_t``."""

    w_t: F32  # [K, N]


@dataclass(frozen=True)
class NBitsLinear:
    """Inputs of ``MatMulNBits``.

    With ``offset_blocks > 0`` the weight has ``offset_blocks`` extra input blocks
    holding the per-block offsets, and its input must be
    ``concat(x, x @ blocksum_matrix(input_k, offset_blocks))``.
    """

    bits: int
    input_k: int  # K of the activation
    n: int
    packed: U8  # [N, k/32, 32*bits/8]
    scales: F32  # [N, k/32]
    zero_points: U8 | None  # [N, k/32] unpacked (8-bit only); None: default 2**(bits-1)
    offset_blocks: int = 0

    @property
    def k(self) -> int:
        """K of the MatMulNBits weight (the activation's K plus the offset blocks)."""
        return self.input_k + self.offset_blocks * QK

    @property
    def n_blocks(self) -> int:
        return self.k // QK


@dataclass(frozen=True)
class LinearPart:
    """One GGUF weight taking part in a (possibly fused) projection."""

    ref: TensorRef
    rope_heads: int = 0  # > 0: undo llama.cpp's Q/K row permutation for this many heads


def rope_unpermute_index(n_rows: int, n_heads: int) -> npt.NDArray[np.intp]:
    """Row index turning llama.cpp's Q/K row order into the rotate-half order.

    llama.cpp's converter stores each head's rows as ``[head_dim/2, 2]`` (pairs
    interleaved for its RoPE kernel); the rotate-half convention needs
    ``[2, head_dim/2]``. ``hf_rows = gguf_rows[index]``.
    """
    head_dim = n_rows // n_heads
    if head_dim * n_heads != n_rows or head_dim % 2:
        raise ValueError(f"{n_rows} rows do not split into {n_heads} heads of even size")
    idx = np.arange(n_rows).reshape(n_heads, head_dim // 2, 2)
    return idx.swapaxes(1, 2).reshape(-1)


def _rows_index(part: LinearPart) -> npt.NDArray[np.intp] | None:
    if part.rope_heads <= 0:
        return None
    return rope_unpermute_index(part.ref.shape[0], part.rope_heads)


def _blockwise(x: F32) -> F32:
    rows, k = x.shape
    if k % QK:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {QK}")
    return x.reshape(rows, k // QK, QK)


def _affine4(part: LinearPart) -> tuple[U8, F32, F32]:
    """4-bit codes ``[rows, nb, 32]``, scale and minimum with ``x = s*code + mn``."""
    ref = part.ref
    if ref.type_name in FOUR_BIT_TYPES:
        b = ref.block_codes()
        return b.codes, b.scale, (b.minimum - b.scale * b.offset).astype(np.float32)
    x = _blockwise(ref.dequantize())
    mn = x.min(axis=-1)
    scale = ((x.max(axis=-1) - mn) / 15.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.rint((x - mn[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return codes, scale, mn.astype(np.float32)


def _affine8(part: LinearPart) -> tuple[U8, F32, U8]:
    """8-bit codes ``[rows, nb, 32]``, scale and integer zero point: ``x = s*(code - zp)``."""
    ref = part.ref
    if ref.type_name in SYMMETRIC_TYPES:
        b = ref.block_codes()
        codes = (b.codes.astype(np.int16) - b.offset + 128).astype(np.uint8)
        return codes, b.scale, np.full(b.scale.shape, 128, dtype=np.uint8)
    x = _blockwise(ref.dequantize())
    lo = np.minimum(x.min(axis=-1), 0.0)  # the range must hold 0 for an integer zero point
    hi = np.maximum(x.max(axis=-1), 0.0)
    scale = ((hi - lo) / 255.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    zp = np.clip(np.rint(-lo / safe), 0, 255)
    codes = np.clip(np.rint(x / safe[..., None]) + zp[..., None], 0, 255).astype(np.uint8)
    return codes, scale, zp.astype(np.uint8)


def _permute(arrays: Sequence[np.ndarray], index: npt.NDArray[np.intp] | None) -> list[np.ndarray]:
    return [a if index is None else a[index] for a in arrays]


def float32_linear(parts: Sequence[LinearPart]) -> Float32Linear:
    rows = []
    for part in parts:
        (w,) = _permute([part.ref.dequantize()], _rows_index(part))
        rows.append(w)
    return Float32Linear(np.ascontiguousarray(np.concatenate(rows, axis=0).T, dtype=np.float32))


def nbits_linear(parts: Sequence[LinearPart], bits: int) -> NBitsLinear:
    """Fuse ``parts`` along the output dimension into one ``MatMulNBits`` weight."""
    codes_l, scale_l, extra_l = [], [], []
    for part in parts:
        if bits == 4:
            codes, scale, extra = _permute(_affine4(part), _rows_index(part))
        elif bits == 8:
            codes, scale, extra = _permute(_affine8(part), _rows_index(part))
        else:
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        codes_l.append(codes)
        scale_l.append(scale)
        extra_l.append(extra)
    codes = np.concatenate(codes_l, axis=0)  # [N, nb, 32]
    scales = np.ascontiguousarray(np.concatenate(scale_l, axis=0), dtype=np.float32)
    extra = np.concatenate(extra_l, axis=0)
    n, nb, _ = codes.shape
    if bits == 4:
        offsets = 8.0 * scales + extra  # [N, nb]: s*q + mn == s*(q - 8) + (8s + mn)
        n_offset = 0
        if np.any(offsets):
            off_codes, off_scales = _offset_blocks(offsets.astype(np.float32))
            codes = np.concatenate([codes, off_codes], axis=1)
            scales = np.concatenate([scales, off_scales], axis=1)
            n_offset = off_codes.shape[1]
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        return NBitsLinear(4, nb * QK, n, packed, scales, None, n_offset)
    zero_points = None if np.all(extra == 128) else extra.astype(np.uint8)
    return NBitsLinear(8, nb * QK, n, codes.astype(np.uint8), scales, zero_points)


def _symmetric4(v: F32) -> tuple[U8, F32, F32]:
    """Blocks ``[..., 32]`` as 4-bit codes with zero point 8; returns codes, scales, values."""
    scale = (np.abs(v).max(axis=-1) / 7.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(v / safe[..., None]), -8, 7)
    return (q + 8).astype(np.uint8), scale, (q * scale[..., None]).astype(np.float32)


def _offset_blocks(offsets: F32) -> tuple[U8, F32]:
    """Per-block offsets ``[N, nb]`` as ``OFFSET_PIECES`` x ``ceil(nb/32)`` 4-bit blocks."""
    n, nb = offsets.shape
    chunks = -(-nb // QK)
    rest = np.zeros((n, chunks * QK), dtype=np.float32)
    rest[:, :nb] = offsets
    rest = rest.reshape(n, chunks, QK)
    codes, scales = [], []
    for _ in range(OFFSET_PIECES):  # coarse, then the residual of what is left
        c, s, approx = _symmetric4(rest)
        codes.append(c)
        scales.append(s)
        rest = rest - approx
    return np.concatenate(codes, axis=1), np.concatenate(scales, axis=1)


def blocksum_matrix(input_k: int, offset_blocks: int) -> F32:
    """``S`` with ``(x @ S)[j] = sum of block b of x`` for every offset piece (0/1 entries)."""
    pieces_width = offset_blocks * QK // OFFSET_PIECES
    s = np.zeros((input_k, offset_blocks * QK), dtype=np.float32)
    rows = np.arange(input_k)
    for piece in range(OFFSET_PIECES):
        s[rows, piece * pieces_width + rows // QK] = 1.0
    return s


def make_linear(parts: Sequence[LinearPart], weights: str) -> Float32Linear | NBitsLinear:
    if weights == "fp32":
        return float32_linear(parts)
    if weights == "int8":
        return nbits_linear(parts, 8)
    if weights == "int4":
        return nbits_linear(parts, 4)
    raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}; got {weights!r}")


def dequantize_nbits(lin: NBitsLinear) -> F32:
    """The float32 ``[N, K]`` matrix a :class:`NBitsLinear` stands for (tests, diagnostics)."""
    if lin.bits == 4:
        codes = np.empty((lin.n, lin.n_blocks, QK), dtype=np.uint8)
        codes[..., 0::2] = lin.packed & 0x0F
        codes[..., 1::2] = lin.packed >> 4
        zp: np.ndarray | int = 8
    else:
        codes = lin.packed
        zp = 128 if lin.zero_points is None else lin.zero_points[..., None].astype(np.float32)
    w = (lin.scales[..., None] * (codes.astype(np.float32) - zp)).reshape(lin.n, lin.k)
    if lin.offset_blocks:
        offsets = w[:, lin.input_k :] @ blocksum_matrix(lin.input_k, lin.offset_blocks).T
        w = w[:, : lin.input_k] + offsets
    return w.astype(np.float32)
