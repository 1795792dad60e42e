"""``python -m bench.static_cache_attention``: what a static-cache graph's
attention costs against the length its caches are bound at.

onnx-genai's static-cache graphs (Mobius ``--static-cache``) attend with the
ONNX ``Attention`` op (opset 24) over caches ``[batch, capacity, kv_hidden]``,
reading ``nonpad_kv_seqlen`` valid positions. Two measurements, on this machine
and ONNX Runtime (docs/design.md, "Engine modules", the static-cache runner):

1. ``layer``: one layer's ``TensorScatter`` + ``Attention`` (SmolLM2's shape:
   9 query heads, 3 KV heads of 64) at 300 tokens of context, bound at 512,
   2,048 and 8,192 positions, for 1 and 4 rows of 1 and 6 new tokens
   (6: a speculative check of 5 guesses).
2. ``runner``: ``StaticCacheRunner`` decoding one sequence from a 300-token
   prompt on an 8-layer model of that shape (tests/tiny_model.py, random fp32
   weights), its caches bound whole at ``--max-len`` against the tiered
   capacity that follows the sequence, in alternating blocks of 20 steps.

    python -m bench.static_cache_attention [--max-len 4096] [--blocks 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

REPO = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
CONTEXT = 300


def _layer_model(capacity: int) -> bytes:
    vi, f32, i64 = helper.make_tensor_value_info, TensorProto.FLOAT, TensorProto.INT64
    q_hidden, kv_hidden = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    nodes = [
        helper.make_node("TensorScatter", ["kc", "k", "wi"], ["ukc"], axis=1),
        helper.make_node("TensorScatter", ["vc", "v", "wi"], ["uvc"], axis=1),
        helper.make_node(
            "Attention",
            ["q", "ukc", "uvc", "", "", "", "nk"],
            ["o"],
            is_causal=1,
            q_num_heads=HEADS,
            kv_num_heads=KV_HEADS,
            scale=HEAD_DIM**-0.5,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [
            vi("q", f32, ["b", "s", q_hidden]),
            vi("k", f32, ["b", "s", kv_hidden]),
            vi("v", f32, ["b", "s", kv_hidden]),
            vi("kc", f32, ["b", capacity, kv_hidden]),
            vi("vc", f32, ["b", capacity, kv_hidden]),
            vi("wi", i64, ["b"]),
            vi("nk", i64, ["b"]),
        ],
        [
            vi("o", f32, ["b", "s", q_hidden]),
            vi("ukc", f32, ["b", capacity, kv_hidden]),
            vi("uvc", f32, ["b", capacity, kv_hidden]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    return model.SerializeToString()


def layer(threads: int, repeats: int = 50) -> list[dict]:
    """Microseconds per call of one layer's attention, by bound length and shape."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    rng = np.random.default_rng(0)
    rows = []
    for capacity in (512, 2048, 8192):
        session = ort.InferenceSession(
            _layer_model(capacity), options, providers=["CPUExecutionProvider"]
        )
        for batch, new in ((1, 1), (4, 1), (1, 6), (4, 6)):
            caches = [
                rng.standard_normal((batch, capacity, KV_HEADS * HEAD_DIM), dtype=np.float32)
                for _ in range(2)
            ]
            binding = session.io_binding()
            feeds = {
                "q": rng.standard_normal((batch, new, HEADS * HEAD_DIM), dtype=np.float32),
                "k": rng.standard_normal((batch, new, KV_HEADS * HEAD_DIM), dtype=np.float32),
                "v": rng.standard_normal((batch, new, KV_HEADS * HEAD_DIM), dtype=np.float32),
                "wi": np.full(batch, CONTEXT, np.int64),
                "nk": np.full(batch, CONTEXT + new, np.int64),
            }
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for (cin, cout), cache in zip((("kc", "ukc"), ("vc", "uvc")), caches, strict=True):
                value = ort.OrtValue.ortvalue_from_numpy(cache)
                binding.bind_ortvalue_input(cin, value)
                binding.bind_ortvalue_output(cout, value)
            binding.bind_output("o")
            for _ in range(5):
                session.run_with_iobinding(binding)
            started = time.perf_counter()
            for _ in range(repeats):
                session.run_with_iobinding(binding)
            us = (time.perf_counter() - started) / repeats * 1e6
            rows.append({"capacity": capacity, "rows": batch, "new_tokens": new, "us": us})
    return rows


def runner(threads: int, max_len: int, blocks: int) -> dict[str, list[float]]:
    """ms per decode step, bound whole at ``max_len`` and tiered, block by block."""
    sys.path.insert(0, str(REPO))
    from genai_service.config import RunnerConfig
    from genai_service.engine.runner.model_runner import StepItem
    from genai_service.engine.runner.static_cache_runner import StaticCacheRunner
    from genai_service.model.model_dir import load_model_spec
    from tests.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        num_layers=8,
        hidden=HEADS * HEAD_DIM,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate=1536,
        max_seq_len=max_len,
        attention="static_cache",
        config="inference_metadata",
        tokenizer="bytes",
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model_spec(build_tiny_model(tmp, spec))
        assert model.static_cache is not None and model.static_cache.capacity is None
        bound = dataclasses.replace(
            model, static_cache=dataclasses.replace(model.static_cache, capacity=max_len)
        )
        config = RunnerConfig(intra_op_threads=threads)
        runners = {  # the sessions are loaded while the directory exists
            "bound whole": StaticCacheRunner(bound, config, 1, max_len),
            "tiered": StaticCacheRunner(model, config, 1, max_len),
        }
    prompt = [5 + i % 200 for i in range(CONTEXT)]
    held = {}
    for name, r in runners.items():
        r.run([StepItem(1, prompt, 0)])
        held[name] = len(prompt)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for block in range(blocks):
        order = list(runners) if block % 2 == 0 else list(reversed(runners))
        for name in order:
            r = runners[name]
            started = time.perf_counter()
            for _ in range(20):
                r.run([StepItem(1, [7], held[name])])
                held[name] += 1
            times[name].append((time.perf_counter() - started) / 20 * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args(argv)
    print("| bound positions | rows × new tokens | µs per layer |")
    print("|---:|---|---:|")
    for row in layer(args.threads):
        print(f"| {row['capacity']:,} | {row['rows']} × {row['new_tokens']} | {row['us']:.0f} |")
    print()
    for name, ms in runner(args.threads, args.max_len, args.blocks).items():
        print(f"{name}: {statistics.median(ms):.2f} ms per decode step (blocks: {ms})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
