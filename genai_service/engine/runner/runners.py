"""The runner factory: which ``ModelRunner`` a model gets (docs/design.md, Engine modules).

Kept apart from ``model_runner`` (the interface and the past/present runner) so
that the base module knows none of its subclasses.
"""

from __future__ import annotations

from ...config import RunnerConfig
from ...model.model_dir import ModelSpec
from ...model.rope import load_rope_tables
from .model_runner import ModelRunner, PastPresentRunner
from .shared_buffer_runner import SharedBufferRunner
from .static_cache_runner import StaticCacheRunner


def create_runner(
    spec: ModelSpec, config: RunnerConfig, max_slots: int, max_len: int
) -> ModelRunner:
    """Pick the runner the graph allows: static-cache for onnx-genai's
    static-cache graphs (the only one that can run them), shared-buffer for
    GroupQueryAttention graphs, past/present otherwise (``config.runner`` may
    force one of the last two)."""
    kind = config.runner
    if kind == "auto":
        if spec.static_cache is not None:
            kind = "static_cache"
        else:
            kind = "shared_buffer" if spec.uses_gqa else "past_present"
    if (kind == "static_cache") != (spec.static_cache is not None):
        raise ValueError(
            f"runner: {kind} cannot run this graph; it has "
            + (
                "static-cache I/O (use static_cache or auto)"
                if spec.static_cache is not None
                else "past/present KV, not onnx-genai's static cache"
            )
        )
    runner: ModelRunner
    if kind == "static_cache":
        runner = StaticCacheRunner(spec, config, max_slots=max_slots, max_len=max_len)
    elif kind == "shared_buffer":
        if not spec.uses_gqa:
            raise ValueError(
                "runner: shared_buffer needs a graph with com.microsoft.GroupQueryAttention"
            )
        runner = SharedBufferRunner(spec, config, max_slots=max_slots, max_len=max_len)
    else:
        runner = PastPresentRunner(spec, config)
    if spec.rope_sources is not None:
        runner.rope = load_rope_tables(spec.onnx_path, spec.rope_sources)
    return runner
