"""Model runners: turn "compute these tokens of these sequences" into logits.

One interface, implementations per KV strategy (docs/design.md, "Engine modules"). A runner owns the
KV of every sequence it runs, keyed by the engine's ``seq_id``; the engine
only moves KV in and out as host arrays (prefix hits, session parking).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from ...config import RunnerConfig
from ...model.model_dir import ModelSpec
from ...model.rope import RopeTable
from ..kv.prefix_cache import KvLayers, join_chunks
from .huge_pages import load_session
from .step_item import StepItem

__all__ = ["ModelRunner", "PastPresentRunner", "StepItem", "make_session_options"]


class ModelRunner(ABC):
    """Contract: ``run`` computes each item's tokens, extends that sequence's KV
    by them, and returns the logits of each item's last token as ``[items,
    vocab]`` float32, in item order; the array may be reused by the runner's
    next ``run`` (a decode step's logits land in a buffer bound once), so a
    caller that keeps it longer copies it. KV of sequences not in the step is left
    untouched. ``read_kv``/``write_kv`` move KV as per-layer ``(K, V)`` host
    arrays ``[kv_heads, tokens, head_dim]``.
    """

    kind: str
    spec: ModelSpec
    # Each layer's rotary tables (model/rope.py) when the graph's keys can be
    # moved to new positions by ``shift``; None: they cannot.
    rope: list[RopeTable] | None = None

    @abstractmethod
    def run(self, items: Sequence[StepItem]) -> np.ndarray: ...

    @abstractmethod
    def kv_len(self, seq_id: int) -> int:
        """Tokens of KV held for ``seq_id`` (0 if none)."""

    @abstractmethod
    def read_kv(self, seq_id: int, start: int, end: int) -> KvLayers:
        """A copy of the KV of positions ``start:end``."""

    @abstractmethod
    def write_kv(self, seq_id: int, layers: KvLayers) -> None:
        """Make ``layers`` the whole KV of ``seq_id`` (which must hold none)."""

    def write_chunks(self, seq_id: int, chunks: Sequence[KvLayers]) -> None:
        """Make consecutive chunks (each per-layer ``(K, V)``) the whole KV of
        ``seq_id``. Runners that can place chunks without joining them first
        override this."""
        self.write_kv(seq_id, join_chunks(chunks))

    @abstractmethod
    def release(self, seq_id: int) -> None:
        """Free everything held for ``seq_id`` (no-op if nothing is)."""

    def _check_start(self, item: StepItem) -> None:
        """``item`` must continue its sequence's KV exactly where it ends."""
        held = self.kv_len(item.seq_id)
        if held != item.start:
            raise ValueError(
                f"sequence {item.seq_id}: step starts at {item.start} but {held} tokens of KV"
            )

    @property
    def can_verify(self) -> bool:
        """Whether ``verify`` works: the graph gives logits for every position,
        or for the last ``num_logits_to_keep``."""
        return not self.spec.logits_last_only or self.spec.num_logits_input is not None

    @abstractmethod
    def verify(self, item: StepItem) -> np.ndarray:
        """Compute ``item`` as ``run`` would and return the logits of each of its
        tokens, ``[len(token_ids), vocab]`` (speculative decoding checks a draft
        with them). Needs ``can_verify``."""

    def verify_batch(self, items: Sequence[StepItem]) -> list[np.ndarray]:
        """``verify`` for several sequences (each item its own length): item i's
        ``[len(token_ids), vocab]`` rows. Runners that can check several
        sequences in one ORT call override this."""
        return [self.verify(item) for item in items]

    @property
    def checks_in_one_call(self) -> bool:
        """Whether ``verify_batch`` runs several sequences (of any lengths) in
        one ORT call, so a step's one-token decodes can ride along with its checks."""
        return False

    def prepare_verify_batch(self) -> str | None:
        """Make ``verify_batch`` check several sequences in one ORT call where
        that takes set-up (speculation at batch > 1 asks for it once). None when
        it does; else why not, and it goes on checking one sequence per call."""
        return "this runner checks one sequence per call"

    @abstractmethod
    def truncate(self, seq_id: int, n: int) -> None:
        """Keep only the first ``n`` tokens of ``seq_id``'s KV (drops the KV of
        draft tokens that were not accepted)."""

    def shift(self, seq_id: int, start: int, drop: int) -> None:
        """Drop the KV of positions ``start .. start+drop-1`` of ``seq_id``: the
        KV after them moves ``drop`` positions down, its keys rotated there
        (``rope``), so positions stay contiguous (the context window's slide)."""
        held = self.kv_len(seq_id)
        if self.rope is None:
            raise ValueError("this graph's keys cannot be shifted (no rotary tables)")
        if not (start >= 0 and drop >= 1 and start + drop < held):
            raise ValueError(
                f"sequence {seq_id}: cannot drop {drop} tokens at {start} of {held} tokens of KV"
            )
        self._shift(seq_id, start, drop, held)

    @abstractmethod
    def _shift(self, seq_id: int, start: int, drop: int, held: int) -> None: ...

    def _shifted(self, layer: int, keys: np.ndarray, drop: int) -> np.ndarray:
        assert self.rope is not None
        return self.rope[layer].shift(keys, drop)


_shared_pool = False  # the process's global intra-op pool is made


def make_session_options(config: RunnerConfig) -> ort.SessionOptions:
    """``config.shared_thread_pool``: the process's one intra-op pool, made
    before its first session (``set_global_thread_pool_sizes``; once it exists
    ORT refuses sessions with pools of their own, so every later one uses it)."""
    global _shared_pool
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if config.shared_thread_pool and not _shared_pool:
        from onnxruntime.capi import _pybind_state

        _pybind_state.set_global_thread_pool_sizes(config.intra_op_threads, 1)
        _shared_pool = True
    if _shared_pool:
        options.use_per_session_threads = False
    elif config.intra_op_threads:
        options.intra_op_num_threads = config.intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Errors only: ORT warns on every load of a graph with an optional input
    # (``num_logits_to_keep``) and on every verification step, whose logits
    # are wider than the declared ``[batch, 1, vocab]``. Failures still raise.
    options.log_severity_level = 3
    return options


class PastPresentRunner(ModelRunner):
    """Any decoder with ``past_key_values.*`` inputs and ``present.*`` outputs.

    Each sequence keeps its own per-layer KV arrays (the previous step's
    ``present``). Decodes of several sequences run as one padded batch:
    left-padded for plain attention graphs (the mask hides the padding and
    ``position_ids`` carry each row's true positions), right-padded for
    GroupQueryAttention graphs (which read each row's length from the mask).
    Prefill chunks run one sequence at a time.
    """

    kind = "past_present"

    def __init__(self, spec: ModelSpec, config: RunnerConfig) -> None:
        self.spec = spec
        self.session = load_session(str(spec.onnx_path), make_session_options(config), config)
        self._dtype = np.dtype(spec.kv.dtype)
        self._right_pad = spec.uses_gqa
        self._output_names = ["logits"] + [n for pair in spec.present_names for n in pair]
        self._kv: dict[int, KvLayers] = {}

    # -- KV bookkeeping -------------------------------------------------------

    @property
    def active(self) -> int:
        """Sequences holding KV."""
        return len(self._kv)

    def kv_len(self, seq_id: int) -> int:
        layers = self._kv.get(seq_id)
        return 0 if not layers else int(layers[0][0].shape[1])

    def read_kv(self, seq_id: int, start: int, end: int) -> KvLayers:
        layers = self._kv[seq_id]
        return [(k[:, start:end].copy(), v[:, start:end].copy()) for k, v in layers]

    def write_kv(self, seq_id: int, layers: KvLayers) -> None:
        if self.kv_len(seq_id):
            raise ValueError(f"sequence {seq_id} already holds KV")
        self._kv[seq_id] = [
            (np.ascontiguousarray(k, self._dtype), np.ascontiguousarray(v, self._dtype))
            for k, v in layers
        ]

    def release(self, seq_id: int) -> None:
        self._kv.pop(seq_id, None)

    def truncate(self, seq_id: int, n: int) -> None:
        held = self.kv_len(seq_id)
        if not 0 <= n <= held:
            raise ValueError(f"sequence {seq_id}: cannot keep {n} of {held} tokens of KV")
        self._kv[seq_id] = [(k[:, :n], v[:, :n]) for k, v in self._kv[seq_id]]

    def _shift(self, seq_id: int, start: int, drop: int, held: int) -> None:
        self._kv[seq_id] = [
            (
                np.concatenate([k[:, :start], self._shifted(layer, k[:, start + drop :], drop)], 1),
                np.concatenate([v[:, :start], v[:, start + drop :]], 1),
            )
            for layer, (k, v) in enumerate(self._kv[seq_id])
        ]

    def _empty_kv(self) -> KvLayers:
        kv = self.spec.kv
        empty = np.zeros((kv.num_kv_heads, 0, kv.head_dim), self._dtype)
        return [(empty, empty) for _ in range(kv.num_layers)]

    # -- compute --------------------------------------------------------------

    def run(self, items: Sequence[StepItem]) -> np.ndarray:
        for item in items:
            self._check_start(item)
        logits = np.empty((len(items), self._vocab_dim()), np.float32)
        decodes = [i for i, item in enumerate(items) if len(item.token_ids) == 1]
        for i, item in enumerate(items):
            if len(item.token_ids) != 1:
                logits[i] = self._run_batch([item])[0, -1]
        # A lone decode needs no padding; several run as one padded batch.
        if decodes:
            logits[decodes] = self._run_batch([items[i] for i in decodes])[:, -1]
        return logits

    def verify(self, item: StepItem) -> np.ndarray:
        self._check_start(item)
        return self._run_batch([item], keep=len(item.token_ids))[0]

    def _vocab_dim(self) -> int:
        return self.spec.vocab_size

    def _run_batch(self, items: Sequence[StepItem], keep: int = 1) -> np.ndarray:
        """One ORT call; all items have the same number of new tokens. Returns
        the logits of the last ``keep`` positions, ``[batch, keep, vocab]``."""
        spec = self.spec
        batch = len(items)
        n_new = len(items[0].token_ids)
        pasts = [self._kv.get(item.seq_id) or self._empty_kv() for item in items]
        lens = [item.start for item in items]
        max_past = max(lens)
        total = max_past + n_new

        feeds: dict[str, np.ndarray] = {
            "input_ids": np.asarray([list(item.token_ids) for item in items], np.int64)
        }
        # [batch, total]: 1 where a key position holds a real token.
        mask = np.zeros((batch, total), np.int64)
        positions = np.empty((batch, n_new), np.int64)
        pads = [max_past - n for n in lens]
        for b, n in enumerate(lens):
            positions[b] = np.arange(n, n + n_new)
            if self._right_pad:
                mask[b, : n + n_new] = 1
            else:
                mask[b, pads[b] :] = 1
        if spec.has_attention_mask:
            feeds["attention_mask"] = mask
        if spec.has_position_ids:
            feeds["position_ids"] = positions
        if keep > 1 and spec.logits_last_only:
            if spec.num_logits_input is None:
                raise ValueError("the graph returns only the last position's logits")
            feeds[spec.num_logits_input] = np.array([keep], np.int64)

        for layer, (k_name, v_name) in enumerate(spec.past_names):
            if batch == 1:
                k, v = pasts[0][layer]
                feeds[k_name] = k[None]
                feeds[v_name] = v[None]
                continue
            # [batch, kv_heads, max_past, head_dim], padding rows zero.
            shape = (batch, spec.kv.num_kv_heads, max_past, spec.kv.head_dim)
            k_batch = np.zeros(shape, self._dtype)
            v_batch = np.zeros(shape, self._dtype)
            for b, past in enumerate(pasts):
                k, v = past[layer]
                lo = 0 if self._right_pad else pads[b]
                k_batch[b, :, lo : lo + lens[b]] = k
                v_batch[b, :, lo : lo + lens[b]] = v
            feeds[k_name] = k_batch
            feeds[v_name] = v_batch

        outputs = self.session.run(self._output_names, feeds)
        logits = outputs[0]  # [batch, seq or 1, vocab]
        presents = outputs[1:]
        for b, item in enumerate(items):
            lo = 0 if (self._right_pad or batch == 1) else pads[b]
            hi = lo + lens[b] + n_new
            self._kv[item.seq_id] = [
                (presents[2 * layer][b, :, lo:hi], presents[2 * layer + 1][b, :, lo:hi])
                for layer in range(spec.kv.num_layers)
            ]
        return np.asarray(logits[:, -keep:, :], np.float32)
