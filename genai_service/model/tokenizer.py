"""Tokenizer: text ↔ token ids, and chat messages → prompt text via the model's template.

Wraps a ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``. The chat
template is rendered the way HF transformers renders it (sandboxed jinja2,
``trim_blocks`` and ``lstrip_blocks``), so a template written for transformers
gives the same prompt here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from genai_common import bounded_json
from genai_common.errors import InvalidArgument, ModelLoadError
from genai_service.model.model_config import (
    TOKENIZER_CONFIG_FILE,
    find_chat_template,
    read_json,
    special_token_text,
)
from genai_service.model.model_dir import TOKENIZER_FILE, ModelSpec

# Fill-in-the-middle token spellings (prefix, suffix, middle), in the order
# they are looked for: StarCoder / SmolLM / SantaCoder, Qwen2.5-Coder /
# CodeGemma, Code Llama, DeepSeek-Coder.
FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<PRE>", "<SUF>", "<MID>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)
# Tokens that end a FIM answer where the vocabulary has them.
FIM_END_TOKENS = (
    "<fim_pad>",
    "<|fim_pad|>",
    "<file_sep>",
    "<|file_sep|>",
    "<|endoftext|>",
    "<EOT>",
    "<|repo_name|>",
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]  # FIM_END_TOKENS the vocabulary has: stop tokens of a FIM request


def declared_fim_tokens(config: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """``{"fim_tokens": {"prefix": ..., "suffix": ..., "middle": ...}}`` of a config."""
    declared = config.get("fim_tokens") if isinstance(config, Mapping) else None
    if not isinstance(declared, Mapping):
        return None
    parts = tuple(declared.get(k) for k in ("prefix", "suffix", "middle"))
    if not all(isinstance(p, str) and p for p in parts):
        return None
    return parts  # type: ignore[return-value]


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        declared_fim: tuple[str, str, str] | None = None,
    ) -> None:
        self.inner = inner  # the raw tokenizers object (the detokenizer uses it)
        self.vocab_size: int = inner.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._special_ids = frozenset(
            int(i) for i, tok in inner.get_added_tokens_decoder().items() if tok.special
        )
        self._compiled: jinja2.Template | None = None
        self._variables: set[str] | None = None
        self._declared_fim = declared_fim

    @classmethod
    def from_dir(cls, path: str | Path, spec: ModelSpec | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) from a model directory.

        With ``spec``, its chat template and BOS/EOS ids are used; otherwise the
        template comes from tokenizer_config.json or chat_template.jinja.
        """
        root = Path(path)
        file = root / TOKENIZER_FILE
        if not file.is_file():
            raise ModelLoadError(f"{file}: tokenizer file not found")
        try:
            inner = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"{file.name}: cannot load tokenizer ({e})") from e
        tok_cfg = read_json(root / TOKENIZER_CONFIG_FILE)
        bos = special_token_text(tok_cfg.get("bos_token"))
        eos = special_token_text(tok_cfg.get("eos_token"))
        if spec is None:
            template = find_chat_template(root, tok_cfg)
        else:
            template = spec.chat_template
            # Templates that print bos_token/eos_token need the text; fall back to the ids.
            if bos is None and spec.bos_token_id is not None:
                bos = inner.id_to_token(spec.bos_token_id)
            if eos is None and spec.eos_token_ids:
                eos = inner.id_to_token(spec.eos_token_ids[0])
        declared = declared_fim_tokens(tok_cfg) or declared_fim_tokens(
            read_json(root / "genai_config.json").get("model", {})
        )
        return cls(
            inner, chat_template=template, bos_token=bos, eos_token=eos, declared_fim=declared
        )

    # --- tokens ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """Display text of one token (for logprobs).

        A byte-level piece that is not complete UTF-8 on its own decodes with
        replacement characters; special tokens show their text.
        """
        return str(self.inner.decode([token_id], skip_special_tokens=False))

    def special_token_ids(self) -> set[int]:
        return set(self._special_ids)

    # --- fill in the middle ----------------------------------------------------------------

    @functools.cached_property
    def fim(self) -> FimTokens | None:
        """The model's fill-in-the-middle tokens, if its vocabulary has them:
        declared (``fim_tokens`` in tokenizer_config.json or genai_config.json,
        ``FimTokens.declared``), else found by the spellings of the model
        families that use them (``FIM_SPELLINGS``)."""
        vocab = self.inner.get_vocab(with_added_tokens=True)
        spellings = [self._declared_fim] if self._declared_fim else list(FIM_SPELLINGS)
        for prefix, suffix, middle in spellings:
            if prefix in vocab and suffix in vocab and middle in vocab:
                ends = tuple(sorted({vocab[t] for t in FIM_END_TOKENS if t in vocab}))
                return FimTokens(vocab[prefix], vocab[suffix], vocab[middle], ends)
        return None

    def fim_ids(self, prefix: str, suffix: str, spm: bool, add_special_tokens: bool) -> list[int]:
        """The prompt of a fill-in-the-middle request (PSM, or SPM with ``spm``);
        INVALID_ARGUMENT when the model has no FIM tokens."""
        fim = self.fim
        if fim is None:
            looked = ", ".join("/".join(s) for s in FIM_SPELLINGS)
            raise InvalidArgument(
                "fim: the model's tokenizer has no fill-in-the-middle tokens (looked for "
                f"{looked}, and a fim_tokens entry in tokenizer_config.json or genai_config.json)"
            )
        head = self.encode("", add_special_tokens=True) if add_special_tokens else []
        pre = self.encode(prefix, add_special_tokens=False)
        suf = self.encode(suffix, add_special_tokens=False)
        if spm:
            return [*head, fim.prefix, fim.suffix, *suf, fim.middle, *pre]
        return [*head, fim.prefix, *pre, fim.suffix, *suf, fim.middle]

    # --- chat --------------------------------------------------------------------------

    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` (each with ``role`` and ``content``; optionally
        ``name``, ``tool_call_id`` and ``tool_calls`` in Hugging Face's form)
        into prompt text, offering ``tools`` (Hugging Face's form:
        ``{"type": "function", "function": {name, description, parameters}}``).

        A template that uses ``tools`` gets them as that variable; one that
        does not gets them in ``TOOL_PREAMBLE``, in the system message. An
        assistant message's ``tool_calls`` that the template does not render
        are written into its content in the preamble's syntax.

        The template writes the special tokens itself (BOS, turn markers), so
        callers encode the result with ``add_special_tokens=False``.

        Raises ``InvalidArgument`` when the model has no template, a message is
        malformed, or the template rejects the conversation.
        """
        if not self.chat_template:
            raise InvalidArgument(
                "messages: this model has no chat template; send text or token_ids instead"
            )
        checked = _check_messages(messages)
        uses = self._template_variables()
        if "tool_calls" not in self.chat_template:
            checked = [_calls_as_content(m) for m in checked]
        variables: dict[str, Any] = {
            "messages": checked,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            if "tools" in uses:
                variables["tools"] = [dict(t) for t in tools]
            else:
                checked[:] = _with_tool_preamble(checked, tools)
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        # A request's chat_template_kwargs: more variables, never the ones above.
        variables = {**(extra or {}), **variables}
        try:
            if self._compiled is None:
                self._compiled = _environment().from_string(self.chat_template)
            return self._compiled.render(**variables)
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"messages: chat template error: {e}") from e
        except Exception as e:  # a template tripping over unexpected input is still bad input
            raise InvalidArgument(f"messages: chat template error: {type(e).__name__}: {e}") from e

    def _template_variables(self) -> set[str]:
        """The variables the chat template reads (``tools``, ``messages``, ...)."""
        if self._variables is None:
            assert self.chat_template is not None
            try:
                ast = _environment().parse(self.chat_template)
            except jinja2.TemplateError as e:
                raise InvalidArgument(f"messages: chat template error: {e}") from e
            self._variables = set(jinja2.meta.find_undeclared_variables(ast))
        return self._variables

    def render_continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        history_ends_with: str = "",
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The text that continues an existing conversation with ``messages``.

        A session turn must not repeat what the template writes once per
        conversation (BOS, a default system prompt). We render a placeholder
        earlier turn followed by ``messages`` and keep what comes after the
        placeholder: the end of the previous turn, the new messages and the
        generation prompt. ``history_ends_with`` is the text of the session's
        last token; if the continuation starts with it (the model already
        produced its end-of-turn token) it is not repeated.
        """
        marker = "\u2063genai-earlier-turn\u2063"
        attempts = (
            [{"role": "assistant", "content": marker}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
        )
        error: InvalidArgument | None = None
        for earlier in attempts:
            try:
                full = self.apply_chat_template(
                    [*earlier, *messages], add_generation_prompt=True, extra=extra
                )
            except InvalidArgument as e:
                error = e
                continue
            if marker not in full:
                break
            text = full[full.index(marker) + len(marker) :]
            if history_ends_with and text.lstrip().startswith(history_ends_with):
                text = text.lstrip()[len(history_ends_with) :]
            return text
        if error is not None:
            raise error
        return self.apply_chat_template(messages, add_generation_prompt=True, extra=extra)


# Offered to a model whose chat template does not render `tools` (docs/design.md,
# "Tool calls"); {tools} is one JSON object per line.
TOOL_PREAMBLE = (
    "You may call these tools (functions). Their signatures, as JSON Schema:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a tool, answer with only a JSON object naming it and its arguments, "
    "inside tags:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments>}}}}\n</tool_call>\n'
    "A tool's result comes back in a message from `tool`."
)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def _with_tool_preamble(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The tools in the system message (prepended to one, or as a new one)."""
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    preamble = TOOL_PREAMBLE.format(tools=listed)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=preamble + "\n\n" + messages[0]["content"])
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def tool_call_text(name: str, arguments: Any) -> str:
    """A call in the preamble's syntax (``arguments``: a mapping or JSON text)."""
    if isinstance(arguments, str):
        arguments = bounded_json.loads(arguments, "arguments") if arguments.strip() else {}
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _calls_as_content(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "\n".join(
        tool_call_text(c["function"]["name"], c["function"].get("arguments", {})) for c in calls
    )
    content = message["content"]
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{text}" if content else text
    return out


_OPTIONAL_KEYS = ("name", "tool_call_id")


def _is_call(call: Any) -> bool:
    return isinstance(call, Mapping) and isinstance(call.get("function"), Mapping)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidArgument("messages: must be a list of {role, content} messages")
    if not messages:
        raise InvalidArgument("messages: must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"messages[{i}]: must be a mapping with role and content")
        for key in ("role", "content"):
            if key not in message:
                raise InvalidArgument(f"messages[{i}].{key}: missing")
            if not isinstance(message[key], str):
                raise InvalidArgument(
                    f"messages[{i}].{key}: must be a string, got {type(message[key]).__name__}"
                )
        for key in _OPTIONAL_KEYS:
            if key in message and not isinstance(message[key], str):
                raise InvalidArgument(
                    f"messages[{i}].{key}: must be a string, got {type(message[key]).__name__}"
                )
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(_is_call(c) for c in calls)):
            raise InvalidArgument(
                f"messages[{i}].tool_calls: must be a list of "
                '{"id", "type": "function", "function": {"name", "arguments"}}'
            )
        checked.append(dict(message))
    return checked


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _shown(token: str | None) -> str:
    return "absent" if token is None else repr(token)


def vocabulary_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why ``draft``'s guesses cannot be read as ``target``'s tokens, or None:
    both vocabularies must hold the same token strings under the same ids."""
    t = {i: s for s, i in target.inner.get_vocab(with_added_tokens=True).items()}
    d = {i: s for s, i in draft.inner.get_vocab(with_added_tokens=True).items()}
    for i in range(max(len(t), len(d), max(t, default=-1) + 1, max(d, default=-1) + 1)):
        if t.get(i) != d.get(i):
            return (
                f"token id {i} is {_shown(t.get(i))} in the target's vocabulary and "
                f"{_shown(d.get(i))} in the draft's ({len(t)} and {len(d)} tokens); "
                "the draft's token ids and strings must equal the target's"
            )
    return None
