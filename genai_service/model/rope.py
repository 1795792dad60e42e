"""Rotary position tables read from a graph, to move cached keys to new positions.

A GroupQueryAttention node with ``do_rotary`` applies RoPE inside the op,
from its own ``cos_cache``/``sin_cache`` inputs, and caches the rotated keys.
RoPE is a rotation whose angle is linear in the position, so a key cached at
position ``p`` moves to ``p - d`` by one more rotation, by ``-d``: the context
window's slide keeps its KV that way (docs/design.md, "Context window").
The tables are the graph's own, so the shift is exact to rounding whatever
base, scaling or partial rotary dimension the exporter baked into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where a graph is read (model_dir.py says why)
    import onnx

# GroupQueryAttention's inputs (com.microsoft): past_key is 3, cos_cache 7, sin_cache 8.
_PAST_KEY, _COS, _SIN = 3, 7, 8


@dataclass(frozen=True)
class RopeSource:
    """Where a layer's rotary tables are in the graph: initializer names."""

    cos: str
    sin: str
    interleaved: bool


class RopeTable:
    """One layer's rotary tables, ``[positions, rotary_dim / 2]`` float32."""

    def __init__(self, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> None:
        self.cos = np.asarray(cos, np.float32)
        self.sin = np.asarray(sin, np.float32)
        self.interleaved = interleaved
        self.half = int(self.cos.shape[1])

    @property
    def positions(self) -> int:
        return int(self.cos.shape[0])

    def is_linear(self) -> bool:
        """Whether the angles grow linearly with the position (then one rotation
        moves a key by any shift); dynamic scalings would not."""
        n = min(self.positions, 64)
        if n < 3:
            return False
        c, s = self.cos[:n].astype(np.float64), self.sin[:n].astype(np.float64)
        # cos((p+1)a) = cos(pa)cos(a) - sin(pa)sin(a), sin likewise
        cos_next = c[:-1] * c[1] - s[:-1] * s[1]
        sin_next = s[:-1] * c[1] + c[:-1] * s[1]
        return bool(
            np.allclose(cos_next, c[1:], atol=1e-4) and np.allclose(sin_next, s[1:], atol=1e-4)
        )

    def shift(self, keys: np.ndarray, by: int) -> np.ndarray:
        """``keys`` (``[..., tokens, head_dim]``, rotated at their positions)
        rotated to positions ``by`` lower; a new array of the same dtype."""
        if not 0 <= by < self.positions:
            raise ValueError(f"cannot shift keys by {by}: the tables have {self.positions} rows")
        out = keys.astype(np.float32, copy=True)
        c, s = self.cos[by], self.sin[by]  # the rotation by -by: cos(by), -sin(by)
        h = self.half
        if self.interleaved:
            x1, x2 = keys[..., 0 : 2 * h : 2], keys[..., 1 : 2 * h : 2]
            out[..., 0 : 2 * h : 2] = x1 * c + x2 * s
            out[..., 1 : 2 * h : 2] = x2 * c - x1 * s
        else:
            x1, x2 = keys[..., :h], keys[..., h : 2 * h]
            out[..., :h] = x1 * c + x2 * s
            out[..., h : 2 * h] = x2 * c - x1 * s
        return out.astype(keys.dtype, copy=False)


def find_rope_sources(
    model: onnx.ModelProto, past_key_names: list[str]
) -> tuple[RopeSource, ...] | None:
    """Each layer's rotary tables (layer order of ``past_key_names``), or None
    unless every layer's GroupQueryAttention node rotates with initializer tables."""
    import onnx

    initializers = {t.name for t in model.graph.initializer}
    by_past: dict[str, RopeSource] = {}
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input)
        if not attrs.get("do_rotary") or len(inputs) <= _SIN:
            return None
        cos, sin = inputs[_COS], inputs[_SIN]
        if cos not in initializers or sin not in initializers:
            return None
        by_past[inputs[_PAST_KEY]] = RopeSource(cos, sin, bool(attrs.get("rotary_interleaved")))
    sources = [by_past.get(name) for name in past_key_names]
    if not sources or any(s is None for s in sources):
        return None
    return tuple(s for s in sources if s is not None)


def load_rope_tables(onnx_path: Path, sources: tuple[RopeSource, ...]) -> list[RopeTable] | None:
    """The tables ``sources`` name, read from the graph (and its external data);
    None if any is not a linear rotary table."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    wanted = {name for s in sources for name in (s.cos, s.sin)}
    arrays: Mapping[str, np.ndarray] = {
        t.name: numpy_helper.to_array(t, base_dir=str(onnx_path.parent))
        for t in model.graph.initializer
        if t.name in wanted
    }
    made: dict[tuple[str, str, bool], RopeTable] = {}
    tables = []
    for s in sources:
        key = (s.cos, s.sin, s.interleaved)
        if key not in made:
            cos, sin = arrays[s.cos], arrays[s.sin]
            if cos.ndim != 2 or cos.shape != sin.shape:
                return None
            made[key] = RopeTable(cos, sin, s.interleaved)
            if not made[key].is_linear():
                return None
        tables.append(made[key])
    return tables
