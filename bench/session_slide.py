"""``python -m bench.session_slide``: a chat session that outgrows its context
window, in-process on the default model with a 512-token window.

    python -m bench.session_slide                # table on stdout, JSON under bench/results/
    python -m bench.session_slide --answer-tokens 64

One 12-turn conversation (chat template, greedy, up to ``--answer-tokens`` per
answer) runs three ways:

- ``slide_rotate``: CONTEXT_OVERFLOW_SLIDE, the kept keys rotated by the shift
  (the default where the graph's GroupQueryAttention applies RoPE);
- ``slide_recompute``: the same slide, the kept tokens recomputed;
- ``reset``: CONTEXT_OVERFLOW_ERROR, and a client that, when the next turn
  would not fit, calls ResetSession and sends its last turns that fit in half
  the window again with the new question (what a client does without a slide).

TTFT is from ``add_request`` to the first token out of ``step``, per turn;
every slide is timed inside the engine (``LLMEngine._slide``: moving the KV,
not the recompute that follows it). The last answers' text is kept, to read.

``measure() -> dict`` and ``markdown(result) -> list[str]`` are the API for
``bench.run`` (section "session_slide").
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

WINDOW = 512
QUESTIONS = [
    "Tell me about the history of the printing press.",
    "Who was Johannes Gutenberg?",
    "How did printing change how people learned to read?",
    "What came after the printing press for spreading news?",
    "Tell me about the telegraph.",
    "How does a telephone work?",
    "What is the difference between radio and television?",
    "Why was the internet invented?",
    "What is an email, in simple words?",
    "How do search engines find web pages?",
    "What should I learn first if I want to build a website?",
    "Give me three tips to stay focused while studying.",
]


def _engine(model_dir: str, threads: int, overflow: str, slide_kv: str) -> Any:
    from genai_service.config import ContextConfig, EngineConfig, RunnerConfig
    from genai_service.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            runner=RunnerConfig(intra_op_threads=threads),
            context=ContextConfig(overflow=overflow, slide_kv=slide_kv),
            max_context_length=WINDOW,
        )
    )


def _turn(
    engine: Any, rid: str, ids: Sequence[int], sid: str, answer_tokens: int
) -> tuple[float, list[int]]:
    """TTFT (s) and the answer's tokens of one session turn, run to its end."""
    from genai_service.contract.request import GenerationRequest, StoppingCriteria

    started = time.perf_counter()
    engine.add_request(
        GenerationRequest(
            rid, tuple(ids), stopping=StoppingCriteria(max_new_tokens=answer_tokens), session_id=sid
        )
    )
    first = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.token_ids:
                first = first if first is not None else time.perf_counter() - started
                tokens.extend(out.token_ids)
    assert first is not None
    return first, tokens


def _conversation(model_dir: str, threads: int, mode: str, answer_tokens: int) -> dict[str, Any]:
    overflow, slide_kv = {
        "slide_rotate": ("slide", "rotate"),
        "slide_recompute": ("slide", "recompute"),
        "reset": ("error", "auto"),
    }[mode]
    engine = _engine(model_dir, threads, overflow, slide_kv)
    slide_ms: list[float] = []
    inner = engine._slide

    def timed_slide(seq: Any, keep_from: int) -> None:
        started = time.perf_counter()
        inner(seq, keep_from)
        slide_ms.append((time.perf_counter() - started) * 1e3)

    engine._slide = timed_slide
    tok = engine.tokenizer
    sid = engine.create_session().session_id
    pairs: list[tuple[str, str]] = []  # (question, answer): what a reset client re-sends
    ttft, answers, resets = [], [], 0
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        text = tok.apply_chat_template(messages) if i == 0 else tok.render_continuation(messages)
        ids = tok.encode(text, add_special_tokens=False)
        held = engine.sessions.get(sid).history
        if mode == "reset" and len(held) + len(ids) + answer_tokens >= WINDOW:
            engine.reset_session(sid)
            resets += 1
            for k in range(len(pairs), -1, -1):  # the most recent turns that fit in half
                earlier = [
                    {"role": role, "content": content}
                    for q, a in pairs[len(pairs) - k :]
                    for role, content in (("user", q), ("assistant", a))
                ]
                ids = tok.encode(
                    tok.apply_chat_template([*earlier, *messages]), add_special_tokens=False
                )
                if len(ids) <= WINDOW // 2 or k == 0:
                    break
        seconds, answer = _turn(engine, f"{mode}-{i}", ids, sid, answer_tokens)
        ttft.append(seconds)
        answers.append(tok.decode(answer))
        pairs.append((question, answers[-1]))
    session = engine.sessions.get(sid)
    result = {
        "ttft_s": ttft,
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "ttft_first_half_median_s": statistics.median(ttft[: len(ttft) // 2]),
        "ttft_second_half_median_s": statistics.median(ttft[len(ttft) // 2 :]),
        "slides": len(slide_ms),
        "slide_ms_median": statistics.median(slide_ms) if slide_ms else 0.0,
        "dropped_tokens": session.dropped_tokens,
        "resets": resets,
        "history_tokens": len(session.history),
        "last_answers": answers[-2:],
        "slide_kv": engine.slide_kv if overflow == "slide" else None,
    }
    engine.close()
    return result


def measure(model_dir: str, threads: int = 2, answer_tokens: int = 96) -> dict:
    runs = {
        mode: _conversation(model_dir, threads, mode, answer_tokens)
        for mode in ("slide_rotate", "slide_recompute", "reset")
    }
    rotate, reset = runs["slide_rotate"], runs["reset"]
    return {
        "window": WINDOW,
        "turns": len(QUESTIONS),
        "answer_tokens": answer_tokens,
        **runs,
        # flat: the second half of the conversation (past the window) against the first
        "rotate_ttft_growth": rotate["ttft_second_half_median_s"]
        / rotate["ttft_first_half_median_s"],
        "rotate_vs_reset_ttft_max": rotate["ttft_max_s"] / reset["ttft_max_s"],
    }


def markdown(result: dict[str, Any]) -> list[str]:
    r = result
    lines = [
        f"One {r['turns']}-turn chat (greedy, up to {r['answer_tokens']} answer tokens per turn) "
        f"in a {r['window']}-token window, in-process; TTFT per turn in seconds.",
        "",
        "| | " + " | ".join(str(i + 1) for i in range(r["turns"])) + " | slides (ms each) "
        "| dropped | resets |",
        "|---|" + "---|" * (r["turns"] + 3),
    ]
    for mode, label in (
        ("slide_rotate", "slide, keys rotated"),
        ("slide_recompute", "slide, kept tokens recomputed"),
        ("reset", "error + ResetSession, recent turns re-sent"),
    ):
        run = r[mode]
        cells = " | ".join(f"{t:.2f}" for t in run["ttft_s"])
        lines.append(
            f"| {label} | {cells} | {run['slides']} ({run['slide_ms_median']:.1f}) | "
            f"{run['dropped_tokens']} | {run['resets']} |"
        )
    last = r["slide_rotate"]["last_answers"][-1].replace("\n", " ").replace("|", "/")[:160]
    lines += [
        "",
        f"Rotated: second-half median TTFT {r['rotate_ttft_growth']:.2f}× the first half's; "
        f"its worst turn {r['rotate_vs_reset_ttft_max']:.2f}× the reset client's worst. "
        f"Its last answer: “{last}…”",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from genai_service.convert.default_model import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model = str(resolve_model(args.model))
    result = measure(model, args.threads, args.answer_tokens)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path(__file__).parent / "results" / f"session_slide-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(markdown(result)))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
