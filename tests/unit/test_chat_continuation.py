"""Session turns given as chat messages continue the conversation instead of restarting it."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from genai_service.model.tokenizer import Tokenizer

# ChatML with a default system prompt, as SmolLM2 ships it.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-2 style: raises unless roles alternate starting with user.
STRICT = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' </s>' }}{% endif %}"
    "{% endfor %}"
)


def tokenizer(template: str) -> Tokenizer:
    inner = HFTokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return Tokenizer(inner, chat_template=template, bos_token="<s>", eos_token="</s>")


def test_continuation_skips_the_system_prompt_and_closes_the_last_turn() -> None:
    tok = tokenizer(CHATML)
    user = [{"role": "user", "content": "And my name?"}]
    # the model ended its turn with <|im_end|>: only the newline is added
    assert tok.render_continuation(user, "<|im_end|>") == (
        "\n<|im_start|>user\nAnd my name?<|im_end|>\n<|im_start|>assistant\n"
    )
    # stopped by max tokens mid-answer: the turn is closed first
    assert tok.render_continuation(user, "Paris") == (
        "<|im_end|>\n<|im_start|>user\nAnd my name?<|im_end|>\n<|im_start|>assistant\n"
    )
    first = tok.apply_chat_template(user)
    assert first.startswith("<|im_start|>system\nYou are helpful.")


def test_continuation_with_a_template_that_insists_on_alternating_roles() -> None:
    tok = tokenizer(STRICT)
    text = tok.render_continuation([{"role": "user", "content": "hi"}], "</s>")
    assert text == "[INST] hi [/INST]"


# Qwen3's switch, as its template reads it.
THINKING = CHATML.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}",
)


def test_chat_template_kwargs_reach_the_template_and_are_checked() -> None:
    """GenerateRequest.chat_template_kwargs (vLLM's chat_template_kwargs):
    more variables for the template, in a first turn and a continuing one;
    the template's own variables cannot be set; only with messages."""
    import json

    import pytest

    from genai_common.errors import InvalidArgument
    from genai_proto.genai.v1 import generate_pb2
    from genai_service.server.convert import template_kwargs

    tok = tokenizer(THINKING)
    user = [{"role": "user", "content": "Hi"}]
    off = {"enable_thinking": False}
    assert tok.apply_chat_template(user, extra=off).endswith("<think>\n\n</think>\n\n")
    assert not tok.apply_chat_template(user).endswith("</think>\n\n")
    assert tok.render_continuation(user, "<|im_end|>", extra=off).endswith("</think>\n\n")
    request = generate_pb2.GenerateRequest(chat_template_kwargs=json.dumps(off))
    assert template_kwargs(request) == off
    for bad, message in (
        ("[1]", "chat_template_kwargs: must be a JSON object"),
        ('{"messages": []}', "chat_template_kwargs: 'messages' is the template's own variable"),
        ('{"a-b": 1}', "chat_template_kwargs: 'a-b' is not a variable name"),
    ):
        with pytest.raises(InvalidArgument) as err:
            template_kwargs(generate_pb2.GenerateRequest(chat_template_kwargs=bad))
        assert err.value.message.startswith(message)
