"""pdserve.tokenizer against transformers' AutoTokenizer on the default model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "Price: 12345.67 dollars on 2024-11-22, π≈3.14159",
    "héllo wörld — ça va? naïve façade",
    "日本語のテキストと中文文本，한국어",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🤔"}],
    [
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Salut ! 日本"},
        {"role": "user", "content": "Encore"},
    ],
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def ref(default_model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok: Tokenizer, ref: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens) == ref.encode(
            text, add_special_tokens=add_special_tokens
        ), text


def test_decode_matches_transformers(tok: Tokenizer, ref: Any) -> None:
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
    assert tok.decode(tok.encode(TEXTS[6])) == TEXTS[6]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, ref: Any, add_generation_prompt: bool
) -> None:
    assert tok.has_chat_template
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages, add_generation_prompt) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    prompt = tok.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_special_ids(tok: Tokenizer, ref: Any) -> None:
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1 == ref.bos_token_id
    assert tok.vocab_size == 49152 == len(ref)


def test_digits_are_split_like_the_original_tokenizer(tok: Tokenizer) -> None:
    # SmolLM's tokenizer (llama.cpp pre "smollm") gives every digit its own token.
    assert len(tok.encode("2024", add_special_tokens=False)) == 4


def test_folder_without_chat_template(default_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    plain = Tokenizer.from_folder(tmp_path)
    assert not plain.has_chat_template
    assert plain.eos_token_ids == (0,) and plain.bos_token_id is None
    with pytest.raises(ValueError, match="chat template"):
        plain.apply_chat_template(CONVERSATIONS[0])


def test_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


STREAM_TEXT = "日本語のテキスト 🎉👍🏽 héllo 👨‍👩‍👧! 中文<|im_end|>"


@pytest.mark.parametrize("with_prompt", [False, True])
def test_incremental_detokenizer_concatenates_to_decode(tok: Tokenizer, with_prompt: bool) -> None:
    ids = tok.encode(STREAM_TEXT)
    prompt = tok.encode("<|im_start|>assistant\n") if with_prompt else None
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == detok.text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some emoji bytes did span tokens and were held back
    assert detok.flush() == ""


def test_incremental_detokenizer_keeps_special_tokens_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode(STREAM_TEXT)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.step(i) for i in ids) == tok.decode(ids, skip_special_tokens=False)
    assert detok.text.endswith("<|im_end|>")


def test_incremental_detokenizer_flush_on_cut_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.step(i) for i in ids[:-1])  # stop in the middle of the emoji
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(ids[:-1])
