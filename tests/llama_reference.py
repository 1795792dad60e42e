"""A numpy reference forward pass of a Llama GGUF model (tests only).

Deliberately independent of the converter: weights are dequantised with the
``gguf`` package's own decoder and kept in llama.cpp's layout, and RoPE is
applied the way llama.cpp does for Llama (adjacent pairs ``(2j, 2j+1)``), so
the converter's row un-permutation + rotate-half GroupQueryAttention is checked
rather than assumed. Computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


@dataclass
class ReferenceModel:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    eps: float
    theta: float
    weights: dict[str, np.ndarray]
    linear_factor: float = 1.0  # rope.scaling.type linear: positions / factor

    @classmethod
    def load(cls, path: str | Path) -> ReferenceModel:
        reader = GGUFReader(str(path))
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
        weights = {}
        for t in reader.tensors:
            w = dequantize(t.data, t.tensor_type)
            weights[t.name] = np.asarray(w, dtype=np.float64).reshape(
                tuple(reversed([int(d) for d in t.shape]))
            )
        return cls(
            n_layers=int(meta["llama.block_count"]),
            n_heads=int(meta["llama.attention.head_count"]),
            n_kv_heads=int(meta["llama.attention.head_count_kv"]),
            eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
            theta=float(meta["llama.rope.freq_base"]),
            weights=weights,
            linear_factor=float(meta.get("llama.rope.scaling.factor", 1.0))
            if meta.get("llama.rope.scaling.type") == "linear"
            else 1.0,
        )

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weights[name]

    def _rope_pairs(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """llama.cpp "NORM" RoPE: rotate adjacent pairs. x: [seq, heads, head_dim]."""
        hd = x.shape[-1]
        inv = self.theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        if "rope_freqs.weight" in self.weights:  # llama.cpp: theta_i / freq_factors[i]
            inv = inv / self.weights["rope_freqs.weight"]
        ang = (pos / self.linear_factor)[:, None, None] * inv[None, None, :]  # [seq, 1, hd/2]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
        out[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
        return out

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits ``[seq, vocab]`` for one sequence starting at position 0."""
        w = self.weights
        seq = len(ids)
        pos = np.arange(seq, dtype=np.float64)
        x = w["token_embd.weight"][np.asarray(ids)]
        causal = np.triu(np.full((seq, seq), -np.inf), k=1)
        group = self.n_heads // self.n_kv_heads
        for i in range(self.n_layers):
            h = self._norm(x, f"blk.{i}.attn_norm.weight")
            q = (h @ w[f"blk.{i}.attn_q.weight"].T).reshape(seq, self.n_heads, -1)
            k = (h @ w[f"blk.{i}.attn_k.weight"].T).reshape(seq, self.n_kv_heads, -1)
            v = (h @ w[f"blk.{i}.attn_v.weight"].T).reshape(seq, self.n_kv_heads, -1)
            q, k = self._rope_pairs(q, pos), self._rope_pairs(k, pos)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]) + causal
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, -1)
            x = x + attn @ w[f"blk.{i}.attn_output.weight"].T
            h = self._norm(x, f"blk.{i}.ffn_norm.weight")
            gate = h @ w[f"blk.{i}.ffn_gate.weight"].T
            up = h @ w[f"blk.{i}.ffn_up.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{i}.ffn_down.weight"].T
        x = self._norm(x, "output_norm.weight")
        head = w.get("output.weight", w["token_embd.weight"])
        return x @ head.T
