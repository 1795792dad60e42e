"""``genai``: command-line client of a genai-grpc server.

    genai --target localhost:50051 generate "Once upon a time" --max-new-tokens 32
    genai generate --token-ids 1,15043 --json
    genai chat --system "You are terse."
    genai session create --idle-ttl-seconds 600
    genai session rewind ID --turns 2
    genai session fork ID
    genai info
    genai tokenize "Hello world"

``generate`` streams text to stdout as it arrives; with ``--json`` it prints
the whole response as protobuf JSON (a ``genai.v1.GenerateResponse``).
Exit status: 0 on success, 1 when a call fails (the status code and message
go to stderr), 2 on bad usage, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from genai_client import _convert
from genai_client.client import Client, Session
from genai_client.errors import GenAIClientError

DEFAULT_TARGET = "localhost:50051"

# Flags shared by `generate` and `chat`: (flag, type, help); the destination
# is the GenerateOptions key of the same name.
_VALUE_FLAGS: list[tuple[str, Any, str]] = [
    ("--max-new-tokens", int, "most tokens to generate"),
    ("--min-new-tokens", int, "EOS and stop token ids cannot stop before this many tokens"),
    ("--temperature", float, "softmax temperature; 0 or unset: greedy"),
    ("--top-k", int, "sample among the K most likely tokens (0: off)"),
    ("--top-p", float, "nucleus sampling probability mass, in (0, 1]"),
    ("--min-p", float, "drop tokens below MIN_P times the top probability"),
    ("--repetition-penalty", float, "penalty on already-seen tokens (1: off)"),
    ("--frequency-penalty", float, "subtracted per occurrence in the output (0: off)"),
    ("--presence-penalty", float, "subtracted once a token occurs in the output (0: off)"),
    ("--seed", int, "random seed (same seed, same tokens)"),
    ("--repetition-penalty-last-n", int, "window of --repetition-penalty (0: whole context)"),
    ("--typical-p", float, "locally typical sampling mass, in (0, 1]"),
    ("--top-a", float, "drop tokens below TOP_A times the top probability squared"),
    ("--xtc-threshold", float, "XTC: tokens above this probability are top choices"),
    ("--xtc-probability", float, "XTC: chance per step of dropping all top choices but one"),
    ("--dry-multiplier", float, "DRY repetition penalty strength (0: off)"),
    ("--dry-base", float, "DRY: penalty base, per token past --dry-allowed-length"),
    ("--dry-allowed-length", int, "DRY: repeats up to this long are free"),
    ("--dry-penalty-last-n", int, "DRY: how far back to look (0: whole context)"),
    ("--mirostat", int, "2: Mirostat v2 (0: off)"),
    ("--mirostat-tau", float, "Mirostat: target surprise in bits"),
    ("--mirostat-eta", float, "Mirostat: learning rate"),
    ("--time-limit-ms", int, "wall-clock budget in milliseconds"),
    ("--top-logprobs", int, "return logprobs with N alternatives per token"),
    ("--prompt-logprobs", int, "return every prompt token's logprob with N alternatives"),
]
_OPTION_KEYS = [flag[2:].replace("-", "_") for flag, _, _ in _VALUE_FLAGS] + [
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_sequence",
    "priority",
    "context_overflow",
    "add_special_tokens",
    "skip_special_tokens",
    "json_schema",
    "regex",
    "grammar",
    "choice",
    "json_object",
    "tools",
    "tool_choice",
    "dry_sequence_breakers",
    "logit_bias",
    "banned_token_ids",
    "allowed_token_ids",
    "bad_words",
]


def _file_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror}") from None


def _choices(text: str) -> list[str]:
    return text.split(",")


def _tools_file(path: str) -> list[Any]:
    try:
        tools = json.loads(_file_text(path))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{path}: not JSON: {e}") from None
    if not isinstance(tools, list):
        raise argparse.ArgumentTypeError(f"{path}: give a JSON list of tools")
    return tools


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _bias(text: str) -> tuple[int, float]:
    token, sep, value = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID:BIAS, got {text!r}") from None


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _generation_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("sampling and stopping")
    for flag, kind, help_text in _VALUE_FLAGS:
        group.add_argument(flag, type=kind, help=help_text, metavar="N" if kind is int else "F")
    group.add_argument("--stop", action="append", metavar="S", help="stop sequence (repeatable)")
    group.add_argument(
        "--dry-sequence-breaker",
        dest="dry_sequence_breakers",
        action="append",
        metavar="S",
        help='DRY: a string that breaks a repeat (repeatable; default \\n : " *)',
    )
    group.add_argument(
        "--logit-bias",
        type=_bias,
        action="append",
        metavar="ID:BIAS",
        help="add BIAS (in [-100, 100]) to a token's logit, e.g. 42:-100 (repeatable)",
    )
    group.add_argument(
        "--banned-token-ids", type=_int_list, metavar="IDS", help="token ids never generated"
    )
    group.add_argument(
        "--allowed-token-ids", type=_int_list, metavar="IDS", help="the only token ids generated"
    )
    group.add_argument(
        "--bad-word", dest="bad_words", action="append", metavar="W", help="never generated"
    )
    group.add_argument(
        "--stop-token-ids",
        type=_int_list,
        metavar="IDS",
        help="comma-separated token ids that stop generation",
    )
    group.add_argument(
        "--ignore-eos",
        action="store_const",
        const=True,
        help="keep generating after end-of-sequence tokens",
    )
    group.add_argument(
        "--include-stop-sequence",
        action="store_const",
        const=True,
        help="keep the matched stop sequence in the text",
    )
    group.add_argument("--priority", choices=["low", "normal", "high"])
    group.add_argument(
        "--context-overflow",
        choices=["error", "slide"],
        help="at the context window: stop, or drop the oldest tokens and go on",
    )
    group.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_const",
        const=False,
        help="do not add special tokens (e.g. BOS) to the prompt",
    )
    group.add_argument(
        "--keep-special-tokens",
        dest="skip_special_tokens",
        action="store_const",
        const=False,
        help="keep special tokens in the generated text",
    )
    structured = parent.add_argument_group(
        "structured output (at most one)"
    ).add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema", type=_file_text, metavar="FILE", help="answer JSON valid under this schema"
    )
    structured.add_argument("--regex", metavar="RE", help="answer matching this regex")
    structured.add_argument(
        "--grammar", type=_file_text, metavar="FILE", help="answer in this Lark or GBNF grammar"
    )
    structured.add_argument(
        "--choice", type=_choices, metavar="A,B,...", help="answer exactly one of these"
    )
    structured.add_argument(
        "--json-object", action="store_const", const=True, help="answer any JSON object"
    )
    tools = parent.add_argument_group("tools")
    tools.add_argument(
        "--tools",
        type=_tools_file,
        metavar="FILE",
        help="JSON list of tools ({name, description, parameters}, or OpenAI's function form); "
        "the prompt is then sent as a user message",
    )
    tools.add_argument("--tool-choice", metavar="C", help="auto, none, required or a tool's name")
    return parent


def _metadata_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metadata",
        type=_key_value,
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="label kept with the session (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``genai`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="genai", description="Command-line client of a genai-grpc server."
    )
    parser.add_argument(
        "--target",
        default=os.environ.get("GENAI_TARGET", DEFAULT_TARGET),
        help="server HOST:PORT (env GENAI_TARGET; default %(default)s)",
    )
    parser.add_argument(
        "--token", default=os.environ.get("GENAI_TOKEN"), help="bearer token (env GENAI_TOKEN)"
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--root-cert", type=Path, help="PEM CA bundle (implies --tls)")
    parser.add_argument("--client-cert", type=Path, help="PEM client certificate (mTLS)")
    parser.add_argument("--client-key", type=Path, help="PEM client key (mTLS)")
    parser.add_argument("--timeout", type=float, help="deadline of each call, in seconds")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    flags = _generation_flags()

    gen = commands.add_parser("generate", parents=[flags], help="generate from a prompt")
    gen.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    gen.add_argument(
        "--token-ids",
        type=_int_list,
        metavar="IDS",
        help="comma-separated prompt token ids instead of text",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message, through the model's chat template (what an "
        "instruct model answers; plain text is continued instead)",
    )
    gen.add_argument("-n", type=int, metavar="N", help="completions to return (printed in turn)")
    gen.add_argument(
        "--best-of", type=int, metavar="N", help="generate N, return the -n most likely"
    )
    gen.add_argument("--fim-prefix", metavar="TEXT", help="fill in the middle: the text before")
    gen.add_argument("--fim-suffix", metavar="TEXT", help="fill in the middle: the text after")
    gen.add_argument("--fim-mode", choices=["psm", "spm"], help="FIM prompt order (default psm)")
    gen.add_argument(
        "--session", dest="session_id", metavar="ID", help="run as a turn of this session"
    )
    gen.add_argument("--request-id", help="request id for server logs")
    gen.add_argument(
        "--json", action="store_true", help="print the whole response as protobuf JSON"
    )

    chat = commands.add_parser("chat", parents=[flags], help="interactive multi-turn chat")
    chat.add_argument(
        "--session",
        dest="session_id",
        metavar="ID",
        help="continue this session (left open on exit)",
    )
    chat.add_argument("--system", help="system message of the first turn")

    session = commands.add_parser("session", help="manage sessions")
    actions = session.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a session")
    create.add_argument("--idle-ttl-seconds", type=int)
    create.add_argument(
        "--context-overflow",
        choices=["error", "slide"],
        help="what its turns do at the context window (default: the server's)",
    )
    _metadata_flag(create)
    for name, help_text in (
        ("get", "describe a session"),
        ("reset", "clear its history"),
        ("close", "close a session"),
    ):
        actions.add_parser(name, help=help_text).add_argument("session_id", metavar="ID")
    rewind = actions.add_parser("rewind", help="step a session back (its KV of the rest stays)")
    rewind.add_argument("session_id", metavar="ID")
    target = rewind.add_mutually_exclusive_group(required=True)
    target.add_argument("--turns", type=int, help="keep the first N turns")
    target.add_argument("--history-tokens", type=int, help="keep the first N tokens")
    fork = actions.add_parser("fork", help="a new session with this one's history and KV")
    fork.add_argument("session_id", metavar="ID")
    fork.add_argument("--turns", type=int, help="only the first N turns")
    fork.add_argument("--idle-ttl-seconds", type=int)
    _metadata_flag(fork)
    actions.add_parser("list", help="list open sessions")

    commands.add_parser("info", help="describe the served model")

    tok = commands.add_parser("tokenize", help="tokenize text")
    tok.add_argument("text")
    tok.add_argument(
        "--no-special-tokens", dest="add_special_tokens", action="store_const", const=False
    )
    tok.add_argument("--json", action="store_true", help="print tokens as JSON")

    detok = commands.add_parser("detokenize", help="decode token ids")
    detok.add_argument("token_ids", type=_int_list, metavar="IDS")
    detok.add_argument(
        "--keep-special-tokens", dest="skip_special_tokens", action="store_const", const=False
    )
    return parser


def _client(args: argparse.Namespace) -> Client:
    def read(path: Path | None) -> bytes | None:
        return path.read_bytes() if path is not None else None

    return Client(
        args.target,
        tls=args.tls,
        root_certificates=read(args.root_cert),
        certificate_chain=read(args.client_cert),
        private_key=read(args.client_key),
        token=args.token,
        timeout=args.timeout,
    )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options = {key: getattr(args, key) for key in _OPTION_KEYS if getattr(args, key) is not None}
    if "logit_bias" in options:  # repeated ID:BIAS pairs; the last one for an id wins
        options["logit_bias"] = dict(options["logit_bias"])
    return options


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _print_json(value: Any, out: TextIO) -> None:
    out.write(json.dumps(_jsonable(value), indent=2, ensure_ascii=False) + "\n")


def _generate(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    options = _options(args)
    for key in ("session_id", "request_id", "n", "best_of"):
        if getattr(args, key):
            options[key] = getattr(args, key)
    prompt = args.prompt
    fim = args.fim_prefix is not None or args.fim_suffix is not None
    if args.fim_mode is not None and not fim:
        raise ValueError("--fim-mode: only with --fim-prefix or --fim-suffix")
    if fim:
        if prompt is not None or args.token_ids is not None:
            raise ValueError("give either a PROMPT, --token-ids or --fim-prefix/--fim-suffix")
        options.update(fim_prefix=args.fim_prefix or "", fim_suffix=args.fim_suffix or "")
        if args.fim_mode:
            options["fim_mode"] = args.fim_mode
    elif args.token_ids is not None:
        if prompt is not None:
            raise ValueError("give either a PROMPT or --token-ids, not both")
        options["token_ids"] = args.token_ids
    elif prompt is None:
        if sys.stdin.isatty():
            raise ValueError("give a PROMPT, --token-ids, or a prompt on stdin")
        prompt = sys.stdin.read()
    if (args.chat or options.get("tools")) and prompt is not None:
        options["messages"] = [("user", prompt)]  # tools go through the chat template too
        prompt = None
    elif args.chat:
        raise ValueError("--chat: needs a PROMPT (text), not --token-ids or FIM")
    if args.json:
        out.write(_convert.result_to_json(client.generate(prompt, **options)) + "\n")
        return 0
    if (args.n or 1) > 1 or (args.best_of or 1) > 1:
        # several completions: each whole, in index order
        result = client.generate(prompt, **options)
        for c in result.completions:
            out.write(f"[{c.index}] {c.text}\n")
        return 0
    with client.stream(prompt, **options) as stream:
        for delta in stream:
            out.write(delta.text)
            out.flush()
    out.write("\n")
    for call in stream.result.tool_calls:
        out.write(f"tool call {call.id}: {call.name}({call.arguments_json})\n")
    return 0


def _chat(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    options = _options(args)
    interactive = sys.stdin.isatty()
    status = 0
    session: Session = client.session(args.session_id)
    with contextlib.ExitStack() as opened:
        opened.enter_context(session)
        err.write(
            f"session {session.id}: /undo steps back a turn, /fork continues in a copy, "
            "/reset clears the history, /exit quits\n"
        )
        first_turn = session.info().turns == 0
        while True:
            if interactive:
                err.write("> ")
                err.flush()
            line = sys.stdin.readline()
            if not line:  # EOF
                break
            line = line.strip()
            if not line:
                continue
            if line == "/exit":
                break
            try:
                if line == "/reset":
                    session.reset()
                    first_turn = True
                    err.write("(history cleared)\n")
                    continue
                if line == "/undo":
                    turns = session.info().turns
                    if turns:
                        first_turn = session.rewind(turns=turns - 1).turns == 0
                    err.write(f"(back to turn {max(turns - 1, 0)})\n")
                    continue
                if line == "/fork":
                    parent = session
                    parent.close_on_exit = False  # kept, to come back to with --session
                    session = opened.enter_context(parent.fork())
                    session.close_on_exit = False
                    err.write(f"(now in session {session.id}; {parent.id} stays open)\n")
                    continue
                messages = [("user", line)]
                if first_turn and args.system:
                    messages.insert(0, ("system", args.system))
                started = time.perf_counter()
                with session.stream(messages=messages, **options) as stream:
                    for delta in stream:
                        out.write(delta.text)
                        out.flush()
                out.write("\n")
                elapsed = max(time.perf_counter() - started, 1e-9)
                tokens = stream.result.usage.completion_tokens or len(stream.result.token_ids)
                err.write(
                    f"[{tokens} tokens in {elapsed:.2f} s, {tokens / elapsed:.1f} tokens/s,"
                    f" {stream.result.finish_reason}]\n"
                )
                first_turn = False
            except GenAIClientError as error:
                _report(error, err)
                status = 1
    return status


def _session(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.action == "create":
        info = client.create_session(
            idle_ttl_seconds=args.idle_ttl_seconds,
            metadata=dict(args.metadata),
            context_overflow=args.context_overflow,
        )
        _print_json(info, out)
    elif args.action == "get":
        _print_json(client.get_session(args.session_id), out)
    elif args.action == "reset":
        _print_json(client.reset_session(args.session_id), out)
    elif args.action == "rewind":
        info = client.rewind_session(
            args.session_id, turns=args.turns, history_tokens=args.history_tokens
        )
        _print_json(info, out)
    elif args.action == "fork":
        info = client.fork_session(
            args.session_id,
            turns=args.turns,
            idle_ttl_seconds=args.idle_ttl_seconds,
            metadata=dict(args.metadata),
        )
        _print_json(info, out)
    elif args.action == "close":
        client.close_session(args.session_id)
    elif args.action == "list":
        _print_json(client.list_sessions(), out)
    return 0


def _tokenize(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    tokens = client.tokenize(args.text, add_special_tokens=args.add_special_tokens)
    if args.json:
        _print_json(tokens, out)
    else:
        for token in tokens:
            out.write(f"{token.id}\t{json.dumps(token.text, ensure_ascii=False)}\n")
    return 0


def _report(error: GenAIClientError, err: TextIO) -> None:
    err.write(f"error: {error.code.name}: {error.details}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``genai`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    try:
        with _client(args) as client:
            if args.command == "generate":
                return _generate(client, args, out)
            if args.command == "chat":
                return _chat(client, args, out, err)
            if args.command == "session":
                return _session(client, args, out)
            if args.command == "info":
                _print_json(client.model_info(), out)
            elif args.command == "tokenize":
                return _tokenize(client, args, out)
            elif args.command == "detokenize":
                text = client.detokenize(
                    args.token_ids, skip_special_tokens=args.skip_special_tokens
                )
                out.write(text + "\n")
            return 0
    except GenAIClientError as error:
        _report(error, err)
        return 1
    except (ValueError, OSError) as error:
        err.write(f"genai: error: {error}\n")
        return 2
    except KeyboardInterrupt:
        err.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
