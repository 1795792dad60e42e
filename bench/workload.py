"""Prompts of exact token lengths, the shape of each measurement, and statistics.

Every engine gets the same token ids. Prompts are cut from one long,
non-periodic token stream (numbered notes rendered to text and tokenized with
the model's own tokenizer) at a moving cursor, so no two prompts of a run
share a leading chunk: nothing a prompt-prefix cache could reuse, except
where a measurement means it to (a session's own history).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from genai_service.model.tokenizer import Tokenizer as EngineTokenizer

_SUBJECTS = (
    "The river pilot",
    "A lighthouse keeper",
    "The night librarian",
    "An apprentice baker",
    "The harbour clerk",
    "A travelling violinist",
    "The orchard surveyor",
)
_VERBS = (
    "wrote down",
    "carefully measured",
    "argued about",
    "quietly repaired",
    "sketched",
    "forgot",
    "counted",
    "rebuilt",
    "photographed",
    "sold",
    "borrowed",
)
_OBJECTS = (
    "the copper kettle",
    "a map of the northern coast",
    "three brass keys",
    "the tide tables",
    "an unfinished letter",
    "the orchard gate",
    "a crate of winter apples",
    "the station clock",
    "two paper lanterns",
    "the ledger of ships",
    "a blue umbrella",
    "the bell tower stairs",
    "a jar of ink",
)
_PLACES = ("the old pier", "the market square", "the hill road", "the mill", "the ferry landing")


def corpus_text(lines: int = 2400) -> str:
    """Deterministic English-like text with no short period."""
    out = []
    for i in range(lines):
        out.append(
            f"Note {i}: {_SUBJECTS[i % 7]} {_VERBS[(i * 3) % 11]} {_OBJECTS[(i * 5) % 13]} "
            f"near {_PLACES[(i * 2) % 5]}, and {(i * 37) % 101} gulls were counted "
            f"on day {(i * 7) % 31 + 1}.\n"
        )
    return "".join(out)


class TokenSource:
    """Hands out fresh token-id prompts of exact lengths from one stream."""

    def __init__(self, model_dir: str | Path, lines: int = 6000) -> None:
        from tokenizers import Tokenizer  # the engine's own dependency

        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tokenizer = tok
        self.model_dir = Path(model_dir)
        self.stream: list[int] = tok.encode(corpus_text(lines), add_special_tokens=False).ids
        self._cursor = 0

    @functools.cached_property
    def _templates(self) -> EngineTokenizer:
        """The engine's tokenizer, for its chat template (loaded once)."""
        from genai_service.model.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.model_dir)

    def chat(self, user: str) -> list[int]:
        """``user`` as one chat turn in the model's template, ready for a reply."""
        text = self._templates.apply_chat_template([{"role": "user", "content": user}])
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def take(self, length: int) -> list[int]:
        """The next ``length`` ids; successive prompts start at different offsets."""
        span = len(self.stream) - length
        if span <= 0:
            raise ValueError(f"prompt of {length} tokens exceeds the corpus")
        start = self._cursor % span
        self._cursor = start + length + 17  # odd stride: starts never realign
        return self.stream[start : start + length]


@dataclass(frozen=True)
class Sampling:
    """One sampling setting, sent the same way to every engine (EOS ignored)."""

    name: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature}"]
        parts += [f"top_p {self.top_p}"] if self.top_p is not None else []
        parts += [f"top_k {self.top_k}"] if self.top_k is not None else []
        if self.repetition_penalty is not None:
            parts.append(f"repetition_penalty {self.repetition_penalty}")
        return ", ".join(parts)

    def params(self) -> dict:
        """The set fields, as ``genai_client`` keyword arguments (empty: greedy)."""
        if self.greedy:
            return {}
        fields = ("temperature", "top_p", "top_k", "repetition_penalty")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


# What chat users send (issue 14): greedy, the common sampled setting, and the
# same with a repetition penalty.
SAMPLINGS = {
    s.name: s
    for s in (
        Sampling("greedy"),
        Sampling("sampled", temperature=0.7, top_p=0.9, top_k=50),
        Sampling("sampled_rep", temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1),
    )
}


# The ``surface`` section's extra fields on top of the sampled row (issue 26):
# DRY, XTC and a few logit biases (JSON-safe: the results keep them).
SURFACE = {
    "dry_multiplier": 0.8,
    "xtc_probability": 0.5,
    "xtc_threshold": 0.1,
    "logit_bias": {100: -5.0, 200: 2.0, 300: -100.0},
}


@dataclass(frozen=True)
class Plan:
    """What one run measures (the shape of every measurement)."""

    reps: int = 3
    threads: int = 2
    single_lengths: tuple[int, ...] = (128, 512, 2048)
    single_new_tokens: int = 128
    session_turns: int = 5
    session_new_prompt_tokens: int = 300
    session_new_tokens: int = 64
    session_conversations: int = 4  # the interleaved case
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    shapes: tuple[tuple[int, int], ...] = ((64, 256), (512, 128))  # (prompt, new tokens)
    speculate: int = 4  # draft tokens of the speculating server (``speculation`` section)
    # Samplings (keys of SAMPLINGS) of every concurrency row, and of the single streams.
    concurrency_samplings: tuple[str, ...] = ("greedy", "sampled", "sampled_rep")
    single_samplings: tuple[str, ...] = ("greedy", "sampled")
    long_context: int = 8192  # ``long`` section: prompt + new tokens (the model's window)
    long_new_tokens: int = 128
    llama_lengths: tuple[int, ...] = (512,)  # ``llama_server`` section: single-stream prompts
    quick: bool = False
    sections: tuple[str, ...] = ("single", "sessions", "concurrency", "speculation")

    @classmethod
    def quick_plan(cls, sections: tuple[str, ...]) -> Plan:
        return cls(
            reps=1,
            single_lengths=(128, 512),
            single_new_tokens=32,
            session_turns=3,
            session_new_prompt_tokens=200,
            session_new_tokens=16,
            concurrency=(1, 4),
            shapes=((64, 64), (512, 32)),
            long_new_tokens=16,
            quick=True,
            sections=sections,
        )

    @property
    def max_total_tokens(self) -> int:
        """Longest sequence any measurement builds (sizes onnxruntime-genai's KV)."""
        single = max(self.single_lengths, default=0) + self.single_new_tokens
        session = self.session_turns * (self.session_new_prompt_tokens + self.session_new_tokens)
        shapes = max((p + n for p, n in self.shapes), default=0)
        return max(single, session, shapes)

    @property
    def long_prompt_tokens(self) -> int:
        return self.long_context - self.long_new_tokens


@dataclass
class Workload:
    """The token ids of one run, drawn up front and given to every engine."""

    warmup: list[int]
    single: dict[int, list[list[int]]] = field(default_factory=dict)  # length -> per rep
    # per rep: conversations x turns of new prompt ids; [0] is the "alone" one
    sessions: list[list[list[list[int]]]] = field(default_factory=list)
    # (prompt, new) -> streams -> per rep: one prompt per stream
    concurrency: dict[tuple[int, int], dict[int, list[list[list[int]]]]] = field(
        default_factory=dict
    )
    # task -> per rep: a chat prompt (see speculation_prompts)
    speculation: dict[str, list[list[int]]] = field(default_factory=dict)
    # per rep: one prompt of Plan.long_prompt_tokens per sampling of the single streams
    long: list[dict[str, list[int]]] = field(default_factory=list)

    @classmethod
    def build(cls, plan: Plan, source: TokenSource) -> Workload:
        w = cls(warmup=source.take(64))
        for length in plan.single_lengths:
            w.single[length] = [source.take(length) for _ in range(plan.reps)]
        convs = 1 + plan.session_conversations
        for _ in range(plan.reps):
            w.sessions.append(
                [
                    [source.take(plan.session_new_prompt_tokens) for _ in range(plan.session_turns)]
                    for _ in range(convs)
                ]
            )
        for shape in plan.shapes:
            w.concurrency[shape] = {
                n: [[source.take(shape[0]) for _ in range(n)] for _ in range(plan.reps)]
                for n in plan.concurrency
            }
        w.speculation = speculation_prompts(source, plan.reps)
        if "long" in plan.sections:
            w.long = [
                {s: source.take(plan.long_prompt_tokens) for s in plan.single_samplings}
                for _ in range(plan.reps)
            ]
        return w


_STORIES = (
    "a lighthouse keeper who finds a message in a bottle",
    "a baker who opens a shop on the moon",
    "two friends lost in a snowy forest",
    "a robot learning to paint",
    "a cat that runs the village post office",
)


def speculation_prompts(source: TokenSource, reps: int) -> dict[str, list[list[int]]]:
    """Chat prompts for the speculation section, per rep: ``copy`` asks for its
    own text back, corrected (answers quote the prompt: prompt-lookup drafts
    fit); ``free`` asks for a story (little to quote: drafts mostly fail);
    ``notes`` is the single-stream section's kind of prompt, 512 tokens of the
    numbered notes, which the model continues in the same pattern."""
    out: dict[str, list[list[int]]] = {"copy": [], "free": [], "notes": []}
    for rep in range(reps):
        notes = source.tokenizer.decode(source.take(160))
        paragraph = notes[notes.find("Note") :]
        out["copy"].append(
            source.chat(f"Rewrite these notes, correcting any mistakes:\n\n{paragraph}")
        )
        out["free"].append(source.chat(f"Write a short story about {_STORIES[rep % 5]}."))
        out["notes"].append(source.take(512))
    return out


# -- statistics ----------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN when empty."""
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else float("nan")


def stream_stats(submit: float, token_times: Sequence[float], token_counts: Sequence[int]) -> dict:
    """TTFT and decode rate of one stream from its token arrival times.

    ``token_times[i]`` is when a delta carrying ``token_counts[i]`` tokens
    arrived. Decode tok/s is ``(n - 1) / (t_last - t_first)``: every token
    after the first over the time between the first and the last.
    """
    n = int(sum(token_counts))
    if n == 0:
        return {"ttft_s": float("nan"), "decode_tok_s": float("nan"), "tokens": 0}
    first, last = token_times[0], token_times[-1]
    decode = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return {"ttft_s": first - submit, "decode_tok_s": decode, "tokens": n, "total_s": last - submit}


def concurrency_stats(submit: float, streams: Sequence[dict]) -> dict:
    """Aggregate tok/s (first submit to last token) and TTFT percentiles of N streams.

    Each stream dict has ``first`` and ``last`` token times and ``tokens``.
    """
    ttfts = [s["first"] - submit for s in streams]
    last = max(s["last"] for s in streams)
    tokens = sum(s["tokens"] for s in streams)
    return {
        "agg_tok_s": tokens / (last - submit),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "wall_s": last - submit,
        "tokens": tokens,
    }


def summarize(reps: Sequence[dict], keys: Sequence[str]) -> dict:
    """Median over reps of each key, plus the raw reps."""
    out: dict = {k: median([r[k] for r in reps if k in r]) for k in keys}
    out["reps"] = list(reps)
    return out
