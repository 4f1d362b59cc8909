"""The gateway's prompt encoding: raw text, token ids, chat messages, and clear errors for bad
input."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdserve.services.gateway.prompt import ChatMessage, Prompt, encode
from pdserve.services.gateway.servicer import prompt_from_proto
from tokenizers import Tokenizer as HFTokenizer

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


def test_text_is_tokenized_as_is(tok):
    ids, text = encode(Prompt(text="Hello, world!"), tok)
    assert ids == tok.encode("Hello, world!")
    assert text == "Hello, world!"


def test_token_ids_are_taken_as_they_are(tok):
    assert encode(Prompt(token_ids=(5, 9, 5)), tok) == ([5, 9, 5], None)
    # what ids must satisfy is validate_prompt's to say, not encode's
    assert encode(Prompt(token_ids=()), tok) == ([], None)


def test_chat_is_rendered_with_the_template(tok):
    chat = (ChatMessage("system", "Be brief."), ChatMessage("user", "2+2?"))
    ids, text = encode(Prompt(chat=chat), tok)
    messages = [{"role": m.role, "content": m.content} for m in chat]
    assert text == tok.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?")
    assert text.endswith("<|im_start|>assistant\n")  # ready for the answer
    # the template wrote the special tokens: none are added twice
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "prompt, message",
    [
        (Prompt(), "no prompt: set one of text, token_ids or chat"),
        (Prompt(text=""), "prompt is empty; give a non-empty text"),
        (Prompt(chat=()), "chat has no messages"),
        (Prompt(text="hi", token_ids=(1,)), "set one prompt, not text and token_ids"),
    ],
)
def test_bad_input_gets_a_clear_error(tok, prompt, message):
    with pytest.raises(ValueError) as err:
        encode(prompt, tok)
    assert str(err.value) == message


def test_a_template_that_refuses_the_messages_is_a_value_error(default_model_dir):
    backend = HFTokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    strict = Tokenizer(
        backend,
        {},
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}",
        (),
        None,
    )
    with pytest.raises(ValueError, match="refused these messages: Conversations must start"):
        encode(Prompt(chat=(ChatMessage("assistant", "hi"),)), strict)


def test_a_tokenizer_without_a_chat_template_says_so(default_model_dir):
    backend = HFTokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    plain = Tokenizer(backend, {}, None, (), None)
    with pytest.raises(ValueError, match="no chat template; send a plain prompt"):
        encode(Prompt(chat=(ChatMessage("user", "hi"),)), plain)


def test_prompt_from_proto():
    req = generation_pb2.GenerateRequest
    assert prompt_from_proto(req(text="")) == Prompt(text="")  # set, even if empty
    assert prompt_from_proto(req(token_ids={"ids": [3, 4]})) == Prompt(token_ids=(3, 4))
    chat = req(chat={"messages": [{"role": "user", "content": "hi"}]})
    assert prompt_from_proto(chat) == Prompt(chat=(ChatMessage("user", "hi"),))
    assert prompt_from_proto(req()) == Prompt()
