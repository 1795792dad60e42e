"""What a runner is asked to compute, apart from the runners themselves so
that the engine's bookkeeping (speculation's proposers) names it without
importing onnxruntime."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepItem:
    """Compute ``token_ids`` for sequence ``seq_id``, whose KV currently covers
    exactly ``start`` tokens (positions ``start .. start+len-1``)."""

    seq_id: int
    token_ids: Sequence[int]
    start: int
