"""The shared-buffer runner: KV written in place by GroupQueryAttention.

See docs/design.md, "Engine modules".

Per layer, K and V live in one buffer ``[max_slots, kv_heads, max_len,
head_dim]`` allocated once (``np.zeros``: pages are only touched, and so only
resident, as sequences grow). The same memory is bound through IOBinding as
both ``past_key_values.*`` and ``present.*``, so ORT's GQA kernel appends new
KV in place: no per-step copy or allocation of KV.

The buffers' position axis is a *capacity* that grows with the longest
sequence held (doubling from ``MIN_CAPACITY``, never below the widest sliding
window, up to ``max_len``; the KV held is moved to the wider layout in place,
within memory reserved once for ``max_len``) and falls back when the long
sequences leave. GQA takes that axis
as its present buffer length and sizes its work split by it: bound at 8,192
positions, each layer's attention over a 200-token context was costed as
8,192-long and split across the intra-op threads, a thread hand-off per head
block for microseconds of work (docs/design.md, "Engine modules").

Each sequence owns a slot; active slots are kept contiguous from 0 (when a
sequence leaves, the last one moves into its slot), so one decode step binds
rows ``[0, B)`` of every buffer. A running sequence that is not decoding this
step (its prompt is mid-prefill) rides along as a dummy row: its token lands
at its current length, past its valid KV, and is overwritten by its next
prefill chunk; its logits are dropped.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import structlog

from ...config import RunnerConfig
from ...model.model_dir import ModelSpec
from ..kv.prefix_cache import KvLayers
from .huge_pages import load_session
from .model_runner import ModelRunner, StepItem, make_session_options
from .verify_graph import (
    BIAS,
    NEW_POSITIONS,
    POSITIONS,
    WINDOW_BIAS,
    Unsupported,
    build_verify_graph,
    new_kv_names,
)

log = structlog.get_logger(__name__)

MIN_CAPACITY = 256  # positions of the narrowest layout


class SharedBufferRunner(ModelRunner):
    kind = "shared_buffer"

    @property
    def tiered(self) -> bool:
        """Whether the position axis follows the sequences held (always, for
        GroupQueryAttention graphs)."""
        return True

    def __init__(self, spec: ModelSpec, config: RunnerConfig, max_slots: int, max_len: int) -> None:
        self._check_graph(spec)
        self.spec = spec
        self.max_slots = max_slots
        self.max_len = max_len
        self.session = load_session(str(spec.onnx_path), make_session_options(config), config)
        self._config = config
        # The graph's twin that checks several sequences' guesses in one call
        # (GroupQueryAttention graphs, once ``prepare_verify_batch`` made it).
        self._verifier: ort.InferenceSession | None = None
        self._verifier_inputs: set[str] = set()
        self._window_biases: list[tuple[int, str]] = []  # (window, its bias input)
        kv = spec.kv
        self._dtype = np.dtype(kv.dtype)
        self._maps: list[mmap.mmap] = []
        size = int(np.prod(self._buffer_shape(max_slots, max_len)))
        # The memory, reserved once for max_len; k_buffers/v_buffers are views
        # of its front in the layout of the current capacity.
        self._k_flat = [self._zeros(size) for _ in range(kv.num_layers)]
        self._v_flat = [self._zeros(size) for _ in range(kv.num_layers)]
        self.capacity = self._tier(0) if self.tiered else max_len
        self.relayouts = 0  # capacity changes, for tests and stats
        self._lay_out()  # and the (empty) caches of OrtValues and bindings over it
        # rows -> the input_ids ([rows, 1]) bound once to the decode binding of
        # rows [0, rows); a decode step writes its tokens into it in place.
        self._decode_ids: dict[int, np.ndarray] = {}
        # The logits of decode steps: rows [0, B) ([B, 1, vocab], a contiguous
        # prefix) are bound once as the output of the decode binding of B rows;
        # valid until the next decode step. Pages are touched only as rows are.
        self._decode_logits = np.empty((max_slots, 1, spec.vocab_size), np.float32)
        self._ones = np.ones(0, np.int64)  # attention masks without padding are views of it
        self._slot: dict[int, int] = {}  # seq_id -> slot
        self._owner: list[int | None] = [None] * max_slots  # slot -> seq_id
        self._len: dict[int, int] = {}  # seq_id -> tokens of valid KV
        self.moves = 0  # slot compactions (KV copies), for tests and stats

    # -- the graph's KV layout (StaticCacheRunner overrides these) --------------

    def _check_graph(self, spec: ModelSpec) -> None:
        if not spec.uses_gqa:
            raise ValueError("the shared-buffer runner needs a GroupQueryAttention graph")

    def _buffer_shape(self, max_slots: int, max_len: int) -> tuple[int, ...]:
        """One layer's K (or V) buffer: ``[max_slots, kv_heads, max_len, head_dim]``."""
        kv = self.spec.kv
        return (max_slots, kv.num_kv_heads, max_len, kv.head_dim)

    def _blocks(self) -> tuple[int, int]:
        """How the layout runs along the position axis: each slot holds this many
        blocks of ``capacity`` positions, each position this many elements wide
        (``[kv_heads, capacity, head_dim]`` per slot: kv_heads blocks of head_dim)."""
        return self.spec.kv.num_kv_heads, self.spec.kv.head_dim

    def _read(self, buf: np.ndarray, slot: int, start: int, end: int) -> np.ndarray:
        """A copy of positions ``start:end`` of ``slot`` as ``[kv_heads, n, head_dim]``."""
        return buf[slot, :, start:end].copy()

    def _write(self, buf: np.ndarray, slot: int, start: int, layer: np.ndarray) -> None:
        """``layer`` (``[kv_heads, n, head_dim]``) into positions ``start:start+n``."""
        buf[slot, :, start : start + layer.shape[1]] = layer

    def _move(self, buf: np.ndarray, dst: int, src: int, n: int) -> None:
        """The first ``n`` positions of slot ``src`` into slot ``dst``."""
        buf[dst, :, :n] = buf[src, :, :n]

    def _bind_lengths(self, binding: ort.IOBinding, lens: list[int], n_new: int) -> None:
        """What tells the graph where each row's new tokens go: GQA reads it from
        the attention mask (right-padded: row b holds lens[b] + n_new real
        positions), plain RoPE graphs from position_ids."""
        batch, total = len(lens), max(lens) + n_new
        if self.spec.has_attention_mask:
            if min(lens) + n_new == total:  # no padding (always so for one row)
                if len(self._ones) < batch * total:
                    self._ones = np.ones(2 * batch * total, np.int64)
                # A view of ones kept across steps: a fresh array right after an
                # ORT call (caches cold) cost ~25 us a step, as much as binding it.
                mask = self._ones[: batch * total].reshape(batch, total)
            else:
                mask = (np.arange(total) < np.asarray(lens)[:, None] + n_new).astype(np.int64)
            binding.bind_cpu_input("attention_mask", mask)
        if self.spec.has_position_ids:
            positions = np.asarray([np.arange(n, n + n_new) for n in lens], np.int64)
            binding.bind_cpu_input("position_ids", positions)

    def _zeros(self, size: int) -> np.ndarray:
        """A zeroed flat buffer of ``size`` elements whose pages become resident
        only when written.

        Not ``np.zeros``: numpy asks for transparent huge pages on large
        arrays, and one 2 MiB page spans a head's whole ``max_len`` row, so the
        first token written to a slot would make every row of it resident
        (~360 MB per slot for SmolLM2 at 8,192 positions).
        """
        nbytes = size * self._dtype.itemsize
        buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            buf.madvise(mmap.MADV_NOHUGEPAGE)
        self._maps.append(buf)
        return np.frombuffer(buf, self._dtype, count=size)

    # -- capacity ---------------------------------------------------------------

    def _lay_out(self) -> None:
        """``k_buffers``/``v_buffers`` as views of the reserved memory's front in
        the current capacity's layout; the OrtValues and bindings over the old
        layout are dropped (the decode steps' ``input_ids`` and logits arrays
        are kept)."""
        shape = self._buffer_shape(self.max_slots, self.capacity)
        size = int(np.prod(shape))
        self.k_buffers = [flat[:size].reshape(shape) for flat in self._k_flat]
        self.v_buffers = [flat[:size].reshape(shape) for flat in self._v_flat]
        self._views: dict[tuple[int, int], list[ort.OrtValue]] = {}
        self._bindings: dict[tuple[int, int, bool, bool], ort.IOBinding] = {}

    def _tier(self, positions: int) -> int:
        """The narrowest layout holding ``positions``: ``MIN_CAPACITY`` doubled, at
        most ``max_len``, and never narrower than the widest sliding window
        (ORT's GroupQueryAttention refuses a present buffer shorter than its
        ``local_window_size`` on some graphs: "sliding_window_cache: KV cache
        capacity (256) must be at least local_window_size (512)", onnxruntime
        1.32 on onnxruntime-genai's builder export of Gemma 3)."""
        need = max(positions, *self.spec.attention_windows, 0)
        capacity = MIN_CAPACITY
        while capacity < need:
            capacity *= 2
        return min(capacity, self.max_len)

    def _reserve(self, positions: int) -> None:
        """Make the layout hold ``positions`` per slot (at most ``max_len``): the
        capacity doubles until it does, and the KV held moves along."""
        if positions > self.capacity:
            self._relay(self._tier(positions))

    def _relay(self, capacity: int) -> None:
        """Move every active slot's KV into the layout of ``capacity`` positions,
        in place: each (slot, block) starts at ``index * capacity * width``
        (``_blocks``), so growing moves the blocks from the last one down (each
        lands at or after its old start, past the blocks still to move) and
        shrinking from the first one up."""
        old = self.capacity
        if capacity == old:
            return
        heads, width = self._blocks()
        lens = self._row_lens(0, len(self._slot))
        blocks = [(slot, h) for slot in range(len(lens)) for h in range(heads)]
        if capacity > old:
            blocks.reverse()
        for flat in self._k_flat + self._v_flat:
            for slot, h in blocks:
                n = lens[slot] * width
                if not n:
                    continue
                index = slot * heads + h
                src = flat[index * old * width : index * old * width + n]
                flat[index * capacity * width : index * capacity * width + n] = src
        self.capacity = capacity
        self.relayouts += 1
        self._lay_out()

    def _row_lens(self, lo: int, hi: int) -> list[int]:
        """Tokens of valid KV in each slot row ``[lo, hi)`` (0 for a free one)."""
        return [self._len[o] if o is not None else 0 for o in self._owner[lo:hi]]

    def _settle(self) -> None:
        """After a sequence leaves: fall back to a narrower layout when the longest
        sequence left fits in a quarter of the capacity (twice its length, so a
        sequence growing again does not move at once)."""
        if not self.tiered or self.capacity <= self._tier(0):
            return
        longest = max((self._len[seq] for seq in self._slot), default=0)
        if 4 * longest <= self.capacity:
            self._relay(self._tier(2 * longest))

    # -- slots ----------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._slot)

    def slot_of(self, seq_id: int) -> int | None:
        return self._slot.get(seq_id)

    def _ensure_slot(self, seq_id: int) -> int:
        slot = self._slot.get(seq_id)
        if slot is not None:
            return slot
        slot = len(self._slot)  # active slots are 0..n-1
        if slot >= self.max_slots:
            raise RuntimeError(f"all {self.max_slots} KV slots are in use")
        self._slot[seq_id] = slot
        self._owner[slot] = seq_id
        self._len[seq_id] = 0
        return slot

    def _ortvalues(self, lo: int, hi: int) -> list[ort.OrtValue]:
        """OrtValues over buffer rows ``[lo, hi)``, K then V per layer (cached)."""
        views = self._views.get((lo, hi))
        if views is None:
            views = []
            for k, v in zip(self.k_buffers, self.v_buffers, strict=True):
                views.append(ort.OrtValue.ortvalue_from_numpy(k[lo:hi]))
                views.append(ort.OrtValue.ortvalue_from_numpy(v[lo:hi]))
            self._views[(lo, hi)] = views
        return views

    # -- KV bookkeeping -------------------------------------------------------

    def kv_len(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def read_kv(self, seq_id: int, start: int, end: int) -> KvLayers:
        slot = self._slot[seq_id]
        return [
            (self._read(k, slot, start, end), self._read(v, slot, start, end))
            for k, v in zip(self.k_buffers, self.v_buffers, strict=True)
        ]

    def write_kv(self, seq_id: int, layers: KvLayers) -> None:
        self.write_chunks(seq_id, [layers])

    def write_chunks(self, seq_id: int, chunks: Sequence[KvLayers]) -> None:
        """Copy each chunk straight into the slot (no joined intermediate)."""
        if self.kv_len(seq_id):
            raise ValueError(f"sequence {seq_id} already holds KV")
        total = sum(int(c[0][0].shape[1]) for c in chunks)
        if total > self.max_len:
            raise ValueError(f"{total} tokens of KV exceed the buffer length {self.max_len}")
        slot = self._ensure_slot(seq_id)
        self._reserve(total)
        start = 0
        for chunk in chunks:
            n = int(chunk[0][0].shape[1])
            for (k_in, v_in), k, v in zip(chunk, self.k_buffers, self.v_buffers, strict=True):
                self._write(k, slot, start, k_in)
                self._write(v, slot, start, v_in)
            start += n
        self._len[seq_id] = total

    def release(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return
        self._len.pop(seq_id, None)
        self._owner[slot] = None
        last = len(self._slot)  # the highest active slot after the pop
        if slot == last:
            self._settle()
            return
        # Keep active slots contiguous: move the last one into the hole.
        mover = self._owner[last]
        assert mover is not None
        n = self._len[mover]
        for k, v in zip(self.k_buffers, self.v_buffers, strict=True):
            self._move(k, slot, last, n)
            self._move(v, slot, last, n)
        self._slot[mover] = slot
        self._owner[slot] = mover
        self._owner[last] = None
        self.moves += 1
        self._settle()

    # -- compute --------------------------------------------------------------

    def run(self, items: Sequence[StepItem]) -> np.ndarray:
        for item in items:
            self._admit(item)
        decodes = {  # slot -> item index
            self._slot[item.seq_id]: i for i, item in enumerate(items) if len(item.token_ids) == 1
        }
        if decodes and list(decodes) == list(range(len(items))):
            # Plain batched decode of the active slots in order (the common
            # step): the ORT output is the answer, no copy.
            return self._decode(items, decodes)
        logits = np.empty((len(items), self.spec.vocab_size), np.float32)
        # Prefill chunks first, one sequence at a time on its own slot row.
        for i, item in enumerate(items):
            if len(item.token_ids) == 1:
                continue
            slot = self._slot[item.seq_id]
            ids = np.asarray([item.token_ids], np.int64)
            logits[i] = self._run(slot, slot + 1, ids, [item.start])[0, -1]
            self._len[item.seq_id] = item.start + len(item.token_ids)
        if decodes:
            out = self._decode(items, decodes)
            for slot, i in decodes.items():
                logits[i] = out[slot]
        return logits

    def verify(self, item: StepItem) -> np.ndarray:
        self._admit(item)
        slot = self._slot[item.seq_id]
        n = len(item.token_ids)
        out = self._run(slot, slot + 1, np.asarray([item.token_ids], np.int64), [item.start], n)
        self._len[item.seq_id] = item.start + n
        return out[0]

    def verify_batch(self, items: Sequence[StepItem]) -> list[np.ndarray]:
        """Several sequences' tokens in one ORT call on the slot rows that span
        them. Each row is fed as many tokens as the longest item, a shorter item
        padded after its own tokens (whose logits are thus untouched: attention
        is causal) and rows of other sequences in the span fed dummy tokens past
        their KV; both land beyond each row's valid length, so the next step
        overwrites them. A GroupQueryAttention graph checks them on its twin
        (``prepare_verify_batch``; ORT's CPU kernel refuses several rows of several
        tokens over a past: "batch_size must be 1 when sequence_length > 1 and
        past context is given", onnxruntime 1.32), which leaves the buffers
        alone, and only the items' own tokens' KV is written back; without a
        twin, and when the padding would not fit inside some row's buffer, one
        call per item."""
        if len(items) < 2 or (self.spec.uses_gqa and self._verifier is None):
            return [self.verify(item) for item in items]
        for item in items:
            self._admit(item)
        n = max(len(item.token_ids) for item in items)
        slots = [self._slot[item.seq_id] for item in items]
        lo, hi = min(slots), max(slots) + 1
        lens = self._row_lens(lo, hi)
        if max(lens) + n > self.max_len:
            return [self.verify(item) for item in items]
        self._reserve(max(lens) + n)
        ids = np.zeros((hi - lo, n), np.int64)  # [rows, n]
        for slot, item in zip(slots, items, strict=True):
            m = len(item.token_ids)
            ids[slot - lo, :m] = item.token_ids
            ids[slot - lo, m:] = item.token_ids[-1]
        if self._verifier is not None:
            try:
                out, new_kv = self._run_twin(lo, hi, ids, lens)
            except Exception:  # it wrote nothing: the items go one call each, now and on
                log.exception("verify_twin_failed", model=str(self.spec.path))
                self._verifier = None
                return [self.verify(item) for item in items]
            for slot, item in zip(slots, items, strict=True):
                self._keep_new_kv(slot, item, new_kv, slot - lo)
        else:
            out = self._run(lo, hi, ids, lens, n)  # [rows, n, vocab]
        rows = []
        for slot, item in zip(slots, items, strict=True):
            m = len(item.token_ids)
            self._len[item.seq_id] = item.start + m
            rows.append(out[slot - lo, :m])
        return rows

    @property
    def checks_in_one_call(self) -> bool:
        return not self.spec.uses_gqa or self._verifier is not None

    def prepare_verify_batch(self) -> str | None:
        """On a GroupQueryAttention graph, build its twin (``verify_graph``) and a
        session of it on the same weights (read from the same files, held a
        second time in memory); graphs with no such limit need nothing. A twin
        that cannot be built leaves one call per sequence (the reason returned)."""
        if not self.spec.uses_gqa or self._verifier is not None:
            return None
        try:
            model = onnx.load(str(self.spec.onnx_path), load_external_data=False)
            twin = build_verify_graph(
                model, self.spec.past_names, self._dtype, self.spec.kv.head_dim
            )
            options = make_session_options(self._config)
            options.add_session_config_entry(  # the weights' files, beside the graph's
                "session.model_external_initializers_file_folder_path",
                str(self.spec.onnx_path.parent),
            )
            self._verifier = load_session(twin.SerializeToString(), options, self._config)
        except Unsupported as exc:
            return str(exc)
        except Exception as exc:  # an ORT or ONNX error: a speed-up lost, not the engine
            log.exception("verify_twin_failed", model=str(self.spec.path))
            return f"the graph's twin failed to build: {exc}"
        self._verifier_inputs = {
            i.name
            for i in self._verifier.get_inputs() + self._verifier.get_overridable_initializers()
        }
        self._window_biases = sorted(
            (int(name[len(WINDOW_BIAS) :]), name)
            for name in self._verifier_inputs
            if name.startswith(WINDOW_BIAS)
        )
        return None

    def _run_twin(
        self, lo: int, hi: int, ids: np.ndarray, lens: list[int]
    ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """The twin's call on buffer rows ``[lo, hi)`` (``ids`` [rows, n], each row
        after its ``lens`` tokens of KV): every position's logits [rows, n,
        vocab] and each layer's new keys and values [rows, kv_heads, n, head_dim]
        (not yet in the buffers)."""
        assert self._verifier is not None
        rows, n = ids.shape
        cap, kv = self.capacity, self.spec.kv
        binding = self._verifier.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        starts = np.asarray(lens, np.int64)[:, None]
        for name in (POSITIONS, NEW_POSITIONS):
            if name in self._verifier_inputs:
                binding.bind_cpu_input(name, starts + np.arange(n, dtype=np.int64))
        # 0 where a row may attend: its own valid past, and its new tokens causally.
        bias = np.empty((rows, 1, n, cap + n), self._dtype)
        past = np.where(np.arange(cap) < starts, 0.0, -np.inf).astype(self._dtype)  # [rows, cap]
        bias[:, 0, :, :cap] = past[:, None, :]
        bias[:, 0, :, cap:] = np.triu(np.full((n, n), -np.inf, self._dtype), 1)
        if BIAS in self._verifier_inputs:
            binding.bind_cpu_input(BIAS, bias)
        # Sliding-window layers also hide what lies ``window`` or more positions back.
        at = starts + np.arange(n)  # [rows, n]: each new token's position
        cols = np.concatenate([np.broadcast_to(np.arange(cap), (rows, cap)), at], axis=1)
        for window, name in self._window_biases:
            too_old = cols[:, None, :] <= at[:, :, None] - window  # [rows, n, cap + n]
            binding.bind_cpu_input(
                name, np.where(too_old[:, None], -np.inf, bias).astype(self._dtype)
            )
        if self.spec.num_logits_input in self._verifier_inputs:
            keep = ort.OrtValue.ortvalue_from_numpy(np.array([n], np.int64))
            binding.bind_ortvalue_input(self.spec.num_logits_input, keep)
        views = self._ortvalues(lo, hi)
        for layer, (pk, pv) in enumerate(self.spec.past_names):
            binding.bind_ortvalue_input(pk, views[2 * layer])
            binding.bind_ortvalue_input(pv, views[2 * layer + 1])
        logits = np.empty((rows, n, self.spec.vocab_size), np.float32)
        self._bind_logits(binding, logits)
        new_kv = []
        for layer in range(kv.num_layers):
            pair = []
            for name in new_kv_names(layer):
                out = np.empty((rows, kv.num_kv_heads, n, kv.head_dim), self._dtype)
                binding.bind_output(name, "cpu", 0, self._dtype, list(out.shape), out.ctypes.data)
                pair.append(out)
            new_kv.append((pair[0], pair[1]))
        self._verifier.run_with_iobinding(binding)
        return logits, new_kv

    def _keep_new_kv(
        self, slot: int, item: StepItem, new_kv: list[tuple[np.ndarray, np.ndarray]], row: int
    ) -> None:
        """Write ``item``'s tokens' keys and values (row ``row`` of the twin's
        outputs) into its slot after its KV, as GroupQueryAttention would have."""
        m = len(item.token_ids)
        for (nk, nv), k, v in zip(new_kv, self.k_buffers, self.v_buffers, strict=True):
            self._write(k, slot, item.start, nk[row, :, :m])
            self._write(v, slot, item.start, nv[row, :, :m])

    def truncate(self, seq_id: int, n: int) -> None:
        held = self.kv_len(seq_id)
        if not 0 <= n <= held or seq_id not in self._slot:
            raise ValueError(f"sequence {seq_id}: cannot keep {n} of {held} tokens of KV")
        self._len[seq_id] = n  # positions past n are overwritten by the next step

    def _shift(self, seq_id: int, start: int, drop: int, held: int) -> None:
        slot = self._slot[seq_id]
        end = held - drop
        for layer, (k, v) in enumerate(zip(self.k_buffers, self.v_buffers, strict=True)):
            k[slot, :, start:end] = self._shifted(layer, k[slot, :, start + drop : held], drop)
            v[slot, :, start:end] = v[slot, :, start + drop : held].copy()
        self._len[seq_id] = end

    def _admit(self, item: StepItem) -> None:
        """Check that ``item`` continues its sequence's KV and fits; give it a slot."""
        self._check_start(item)
        if item.start + len(item.token_ids) > self.max_len:
            raise ValueError(
                f"sequence {item.seq_id}: {item.start + len(item.token_ids)} tokens exceed "
                f"the KV buffer length {self.max_len}"
            )
        self._ensure_slot(item.seq_id)
        self._reserve(item.start + len(item.token_ids))

    def _decode(self, items: Sequence[StepItem], decodes: dict[int, int]) -> np.ndarray:
        """One token for each of ``decodes`` (slot -> item index) in one call on
        rows ``[0, highest slot]``; returns the logits by row."""
        rows = max(decodes) + 1
        lens = self._row_lens(0, rows)
        self._reserve(max(lens) + 1)  # a dummy row writes at its length too
        binding = self._binding(0, rows, decode=True)
        ids = self._decode_ids[rows]
        ids.fill(0)  # dummy rows decode token 0, dropped by the caller
        for slot, i in decodes.items():
            ids[slot, 0] = items[i].token_ids[0]
        out = self._run(0, rows, ids, lens, binding=binding, logits=self._decode_logits[:rows])
        out = out[:, -1]
        for i in decodes.values():
            self._len[items[i].seq_id] += 1
        return out

    def _run(
        self,
        lo: int,
        hi: int,
        input_ids: np.ndarray,
        lens: list[int],
        keep: int = 1,
        binding: ort.IOBinding | None = None,
        logits: np.ndarray | None = None,
    ) -> np.ndarray:
        """One ORT call on buffer rows ``[lo, hi)``; returns the logits of the last
        ``keep`` positions, ``[rows, keep, vocab]``. ``binding``: a decode binding,
        whose ``input_ids`` is already bound to ``input_ids`` and whose logits
        output to ``logits``."""
        spec = self.spec
        batch, n_new = input_ids.shape
        wide = keep > 1 and spec.logits_last_only
        if binding is None:
            binding = self._binding(lo, hi, wide)
            binding.bind_cpu_input("input_ids", input_ids)
        if wide:
            if spec.num_logits_input is None:
                raise ValueError("the graph returns only the last position's logits")
            # An OrtValue: bind_cpu_input looks the name up among the required
            # inputs only, and this one has a default.
            keep_value = ort.OrtValue.ortvalue_from_numpy(np.array([keep], np.int64))
            binding.bind_ortvalue_input(spec.num_logits_input, keep_value)
        self._bind_lengths(binding, lens, n_new)
        if wide:
            # More rows than the declared [batch, 1, vocab] (which onnxruntime-genai
            # relies on): ORT refuses a bound array of that shape, so it allocates
            # the logits itself, afresh each call; they are the binding's first output.
            binding.bind_output("logits", "cpu")
            self.session.run_with_iobinding(binding)
            return np.asarray(binding.get_outputs()[0].numpy())
        # Logits land in an array of ours: reading them back through
        # get_outputs() would wrap every output, the KV buffers included.
        if logits is None:
            rows = 1 if spec.logits_last_only else n_new
            logits = np.empty((batch, rows, spec.vocab_size), np.float32)
            self._bind_logits(binding, logits)
        self.session.run_with_iobinding(binding)
        return logits[:, -keep:, :]

    @staticmethod
    def _bind_logits(binding: ort.IOBinding, logits: np.ndarray) -> None:
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)

    def _binding(self, lo: int, hi: int, wide: bool = False, decode: bool = False) -> ort.IOBinding:
        """An IOBinding with rows ``[lo, hi)`` of the KV buffers bound as both past
        and present; kept per row range, so a step only rebinds its inputs. ``wide``
        bindings also bind ``num_logits_to_keep`` (the others leave its default, 1)
        and let ORT allocate the logits. ``decode`` bindings (``lo`` 0) have their
        ``input_ids`` bound once, to ``_decode_ids[hi]``: one ORT bind call less
        per decode step (the array is contiguous int64, so ORT reads its memory)."""
        key = (lo, hi, wide, decode)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self.session.io_binding()
            if decode:
                ids = self._decode_ids.setdefault(hi, np.zeros((hi - lo, 1), np.int64))
                binding.bind_cpu_input("input_ids", ids)
                self._bind_logits(binding, self._decode_logits[:hi])
            if wide:
                binding.bind_output("logits", "cpu")  # first: get_outputs()[0]
            views = self._ortvalues(lo, hi)
            for layer, ((pk, pv), (ok, ov)) in enumerate(
                zip(self.spec.past_names, self.spec.present_names, strict=True)
            ):
                binding.bind_ortvalue_input(pk, views[2 * layer])
                binding.bind_ortvalue_input(pv, views[2 * layer + 1])
                binding.bind_ortvalue_output(ok, views[2 * layer])
                binding.bind_ortvalue_output(ov, views[2 * layer + 1])
            self._bindings[key] = binding
        return binding
