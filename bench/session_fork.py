"""``python -m bench.session_fork``: what ForkSession and RewindSession cost and
what they save, in-process on the default model.

    python -m bench.session_fork                 # table on stdout, JSON under bench/results/
    python -m bench.session_fork --reps 1

A parent session runs three turns of 128 answer tokens (about 450 tokens of
history). Then,
rep by rep: ``fork_session`` is timed, and the fork's first turn (an 8-token
question) against a fresh session whose first turn sends the parent's whole
history plus the same question (the same prompt, computed from scratch);
``rewind_session`` to turn 1 is timed, and the rewound session's next turn
against a fresh session sending turn 1's history plus the question. TTFT is
from ``add_request`` to the first token out of ``step``; medians over reps.

``measure() -> dict`` and ``markdown(result) -> list[str]`` are the API for
``bench.run`` (section "session_fork").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TURNS = [
    "Tell me about the history of the printing press in a few paragraphs, with dates.",
    "Now compare it with the invention of the telegraph: what changed for ordinary people?",
    "Which of the two mattered more for science, and why? Give three reasons.",
]
QUESTION = "Summarise that in one sentence."
PARENT_ANSWER_TOKENS = 128  # per parent turn: about 450 tokens of history in all


def _engine(model_dir: str, threads: int) -> Any:
    from genai_service.config import CacheConfig, EngineConfig, RunnerConfig
    from genai_service.engine.engine import LLMEngine

    # No prefix index: the fresh sessions must compute their prompt (with one,
    # they would reuse the parent's chunks, which is the fork's point too).
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            runner=RunnerConfig(intra_op_threads=threads),
            cache=CacheConfig(prefix_cache_bytes=0),
        )
    )


def _ids(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text, add_special_tokens=False))


def _ttft(engine: Any, rid: str, ids: Sequence[int], sid: str, new_tokens: int) -> float:
    """Seconds from admission to the first token of a session turn; runs it to the end."""
    from genai_service.contract.request import GenerationRequest, StoppingCriteria

    started = time.perf_counter()
    engine.add_request(
        GenerationRequest(
            rid,
            tuple(ids),
            stopping=StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            session_id=sid,
        )
    )
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.request_id == rid and out.token_ids:
                first = time.perf_counter() - started
    assert first is not None
    return first


def measure(model_dir: str, reps: int = 3, threads: int = 2, new_tokens: int = 32) -> dict:
    engine = _engine(model_dir, threads)
    parent = engine.create_session().session_id
    turn_ends = []
    for i, text in enumerate(TURNS):
        _ttft(engine, f"parent-{i}", _ids(engine, text), parent, PARENT_ANSWER_TOKENS)
        turn_ends.append(engine.get_session(parent).history_tokens)
    history = list(engine.sessions.get(parent).history)
    question = _ids(engine, QUESTION)
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "fork_ms",
            "fork_ttft_s",
            "fresh_full_ttft_s",
            "rewind_ms",
            "rewind_ttft_s",
            "fresh_turn1_ttft_s",
        )
    }
    for rep in range(reps):
        started = time.perf_counter()
        fork = engine.fork_session(parent).session_id
        rows["fork_ms"].append((time.perf_counter() - started) * 1e3)
        rows["fork_ttft_s"].append(_ttft(engine, f"fork-{rep}", question, fork, new_tokens))
        fresh = engine.create_session().session_id
        rows["fresh_full_ttft_s"].append(
            _ttft(engine, f"fresh-{rep}", history + list(question), fresh, new_tokens)
        )
        engine.close_session(fresh)
        started = time.perf_counter()
        engine.rewind_session(fork, turns=1)
        rows["rewind_ms"].append((time.perf_counter() - started) * 1e3)
        rows["rewind_ttft_s"].append(_ttft(engine, f"rewound-{rep}", question, fork, new_tokens))
        engine.close_session(fork)
        fresh = engine.create_session().session_id
        rows["fresh_turn1_ttft_s"].append(
            _ttft(
                engine, f"fresh1-{rep}", history[: turn_ends[0]] + list(question), fresh, new_tokens
            )
        )
        engine.close_session(fresh)
    engine.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "history_tokens": len(history),
        "turn1_tokens": turn_ends[0],
        "question_tokens": len(question),
        "reps": reps,
        **med,
        "fork_ttft_ratio": med["fork_ttft_s"] / med["fresh_full_ttft_s"],
        "rewind_ttft_ratio": med["rewind_ttft_s"] / med["fresh_turn1_ttft_s"],
        "raw": rows,
    }


def markdown(result: dict[str, Any]) -> list[str]:
    r = result
    return [
        f"A parent session of {r['history_tokens']} history tokens (3 turns; turn 1 ends at "
        f"{r['turn1_tokens']}), a {r['question_tokens']}-token question; medians of "
        f"{r['reps']} reps, in-process, prefix index off.",
        "",
        "| | call (ms) | next turn's TTFT (s) | fresh session, same prompt (s) | ratio |",
        "|---|---|---|---|---|",
        f"| ForkSession (whole history) | {r['fork_ms']:.2f} | {r['fork_ttft_s']:.3f} | "
        f"{r['fresh_full_ttft_s']:.3f} | {r['fork_ttft_ratio']:.2f}× |",
        f"| RewindSession to turn 1 | {r['rewind_ms']:.2f} | {r['rewind_ttft_s']:.3f} | "
        f"{r['fresh_turn1_ttft_s']:.3f} | {r['rewind_ttft_ratio']:.2f}× |",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from genai_service.convert.default_model import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model = str(resolve_model(args.model))
    result = measure(model, args.reps, args.threads, args.new_tokens)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parent / "results" / f"session_fork-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
