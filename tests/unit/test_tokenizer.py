"""Tokenizer: encode/decode, special tokens, chat template rendering and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, processors

from genai_common.errors import InvalidArgument, ModelLoadError
from genai_service.model.model_dir import load_model_spec
from genai_service.model.tokenizer import Tokenizer
from tests.unit.test_model_dir import VOCAB, VOCAB_SIZE, write_model_dir, write_word_tokenizer

# ChatML with block tags on their own (indented) lines: it renders right only with
# trim_blocks and lstrip_blocks, as transformers renders it.
CHATML = """\
{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
Default system prompt.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "bye"},
]


def make_tokenizer(tmp_path: Path, tokenizer_config: dict[str, Any] | None = None) -> Tokenizer:
    write_word_tokenizer(tmp_path)
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return Tokenizer.from_dir(tmp_path)


@pytest.fixture
def tok(tmp_path: Path) -> Tokenizer:
    return make_tokenizer(tmp_path, {"chat_template": CHATML, "eos_token": "<|im_end|>"})


# --- tokens ----------------------------------------------------------------------------


def test_encode_decode_round_trip(tok: Tokenizer) -> None:
    ids = tok.encode("hello world")
    assert ids == [VOCAB["hello"], VOCAB["world"]]
    assert tok.decode(ids) == "hello world"
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.inner.token_to_id("cat") == VOCAB["cat"]


def test_add_special_tokens_and_skip_special_tokens(tmp_path: Path) -> None:
    raw = RawTokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("the cat") == [VOCAB["<s>"], VOCAB["the"], VOCAB["cat"]]
    assert tok.encode("the cat", add_special_tokens=False) == [VOCAB["the"], VOCAB["cat"]]
    ids = [VOCAB["<s>"], VOCAB["the"], VOCAB["cat"], VOCAB["</s>"]]
    assert tok.decode(ids) == "the cat"
    assert tok.decode(ids, skip_special_tokens=False) == "<s> the cat </s>"


def test_token_text(tok: Tokenizer) -> None:
    assert tok.token_text(VOCAB["cat"]) == "cat"
    assert tok.token_text(VOCAB["<|im_end|>"]) == "<|im_end|>"  # specials are shown


def test_special_token_ids(tok: Tokenizer) -> None:
    assert tok.special_token_ids() == {0, 1, 2, 3, 4}
    tok.special_token_ids().add(99)  # a copy: callers cannot change the tokenizer
    assert 99 not in tok.special_token_ids()


def test_chat_template_text_encodes_without_added_specials(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == VOCAB["<|im_start|>"]
    assert ids[-2:] == [VOCAB["<|im_start|>"], VOCAB["assistant"]]


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(info.value) == f"{tmp_path / 'tokenizer.json'}: tokenizer file not found"


# --- chat template ---------------------------------------------------------------------


def test_chatml_multi_turn(tok: Tokenizer) -> None:
    assert tok.has_chat_template()
    assert tok.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello world<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chatml_default_system_prompt_without_generation_prompt(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert rendered == (
        "<|im_start|>system\nDefault system prompt.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_template_variables_and_helpers(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% if loop.index == 1 %}"
        "{% break %}{% endif %}{% endfor %}{{ eos_token }}"
    )
    tok = make_tokenizer(
        tmp_path, {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    )
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == ('<s>{"role": "user", "content": "héllo <b>"}</s>')


def test_template_from_spec(tmp_path: Path) -> None:
    d = write_model_dir(
        tmp_path / "m",
        genai_config={"model": {"bos_token_id": VOCAB["<s>"], "eos_token_id": [VOCAB["</s>"]]}},
    )
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"
    )
    spec = load_model_spec(d)
    tok = Tokenizer.from_dir(d, spec)
    # No tokenizer_config.json: BOS/EOS text comes from the spec's ids.
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_no_chat_template(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path)
    assert not tok.has_chat_template()
    with pytest.raises(InvalidArgument) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.message == (
        "messages: this model has no chat template; send text or token_ids instead"
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages: must not be empty"),
        ([{"role": "user", "content": "hi"}, {"content": "x"}], "messages[1].role: missing"),
        ([{"role": "user"}], "messages[0].content: missing"),
        (
            [{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}],
            "messages[1].role: must be a string, got int",
        ),
        (
            [{"role": "user", "content": None}],
            "messages[0].content: must be a string, got NoneType",
        ),
        (["hi"], "messages[0]: must be a mapping with role and content"),
        ("hi", "messages: must be a list of {role, content} messages"),
    ],
)
def test_malformed_messages(tok: Tokenizer, messages: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        tok.apply_chat_template(messages)
    assert info.value.message == message


def test_template_raise_exception(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}"
    )
    tok = make_tokenizer(tmp_path, {"chat_template": template})
    with pytest.raises(InvalidArgument) as info:
        tok.apply_chat_template(CONVERSATION)
    assert info.value.message == "messages: chat template error: System role not supported"


def test_template_syntax_error(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path, {"chat_template": "{% for m in messages %}"})
    with pytest.raises(InvalidArgument) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.message.startswith(
        "messages: chat template error: Unexpected end of template"
    )


@pytest.mark.parametrize(
    ("template", "unsafe"),
    [
        ("{{ messages.__class__.__mro__ }}", "'__class__' of 'list'"),
        ("{{ messages.append(1) }}", "'append' of 'list'"),
    ],
)
def test_template_is_sandboxed(tmp_path: Path, template: str, unsafe: str) -> None:
    tok = make_tokenizer(tmp_path, {"chat_template": template})
    with pytest.raises(InvalidArgument) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.message == (
        f"messages: chat template error: access to attribute {unsafe} object is unsafe."
    )
