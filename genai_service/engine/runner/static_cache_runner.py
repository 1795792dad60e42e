"""The static-cache runner: onnx-genai's fixed-capacity KV graphs.

See docs/design.md, "Engine modules". A graph exported with Mobius's
``--static-cache`` (``ModelSpec.static_cache``) takes each layer's K and V as
one preallocated ``[batch, capacity, num_kv_heads * head_dim]`` buffer,
scatters the step's keys and values into it at ``write_indices`` (the tokens
of valid KV before the step; ``TensorScatter``) and attends over its first
``nonpad_kv_seqlen`` positions (the valid length after the write), returning
the updated buffers.

That is the shared-buffer runner's model with another layout and other
length inputs, so this is ``SharedBufferRunner`` with those parts replaced:
buffers ``[max_slots, max_len, kv_hidden]`` allocated once, bound through
IOBinding as both the cache input and its updated output (written in place),
active slots contiguous from 0, batched decode over rows ``[0, B)``, prefill
chunks one row at a time, and KV moved in and out as ``[kv_heads, n,
head_dim]`` per layer, the chunk format of the other runners.

When the graph leaves the buffers' length open (``StaticCacheIO.capacity``
None), the position axis is tiered as the shared-buffer runner's is: it
follows the longest sequence held. ONNX Runtime's CPU ``Attention`` (opset 24)
costs in proportion to the bound buffer's length, not to ``nonpad_kv_seqlen``
(onnxruntime 1.32, one layer of SmolLM2's shape, one decode row at 300
tokens: 83 us bound at 512 positions, 279 at 2,048, 828 at 8,192;
bench/static_cache_attention.py), so a buffer bound at the engine's whole
context made every step pay for it. A graph that fixes the length gets
buffers of exactly that length, as before.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ...model.model_dir import ModelSpec
from .shared_buffer_runner import SharedBufferRunner


class StaticCacheRunner(SharedBufferRunner):
    kind = "static_cache"

    @property
    def tiered(self) -> bool:
        """Whether the position axis follows the sequences held: only when the
        graph leaves the caches' length open (one it fixes is bound whole)."""
        return self.spec.static_cache is not None and self.spec.static_cache.capacity is None

    def _check_graph(self, spec: ModelSpec) -> None:
        if spec.static_cache is None:
            raise ValueError("the static-cache runner needs a static-cache graph")

    def _blocks(self) -> tuple[int, int]:
        return 1, self.spec.kv.num_kv_heads * self.spec.kv.head_dim  # [capacity, kv_hidden]

    def _buffer_shape(self, max_slots: int, max_len: int) -> tuple[int, ...]:
        kv = self.spec.kv
        capacity = self.spec.static_cache.capacity if self.spec.static_cache else None
        if capacity is not None and capacity < max_len:
            raise ValueError(
                f"the graph's KV caches hold {capacity} positions; the engine needs {max_len}"
            )
        # A graph that fixes the capacity gets buffers of exactly that length.
        return (max_slots, capacity or max_len, kv.num_kv_heads * kv.head_dim)

    def _read(self, buf: np.ndarray, slot: int, start: int, end: int) -> np.ndarray:
        kv = self.spec.kv
        rows = buf[slot, start:end].reshape(end - start, kv.num_kv_heads, kv.head_dim)
        # Always a copy: with one KV head (or one position) the transpose is
        # already contiguous, and ascontiguousarray would hand out a view of the
        # live buffer, which a later step, slot move or relayout overwrites.
        return rows.transpose(1, 0, 2).copy()

    def _write(self, buf: np.ndarray, slot: int, start: int, layer: np.ndarray) -> None:
        n = layer.shape[1]
        buf[slot, start : start + n] = layer.transpose(1, 0, 2).reshape(n, -1)

    def _move(self, buf: np.ndarray, dst: int, src: int, n: int) -> None:
        buf[dst, :n] = buf[src, :n]

    def _bind_lengths(self, binding: ort.IOBinding, lens: list[int], n_new: int) -> None:
        io = self.spec.static_cache
        assert io is not None
        written = np.asarray(lens, np.int64)
        binding.bind_cpu_input(io.write_indices, written)
        binding.bind_cpu_input(io.kv_lengths, written + n_new)

    def _shift(self, seq_id: int, start: int, drop: int, held: int) -> None:
        # Unreachable: a static-cache graph has no rotary tables the engine can
        # read (``rope`` stays None), so its context slides recompute.
        raise ValueError("a static-cache graph's keys cannot be shifted")
