"""A request's prompt as the gateway receives it, and the token ids it stands for.

Prompt(text="...")                   raw text, tokenized as is (no chat template)
Prompt(token_ids=(1, 2, 3))          pre-tokenized
Prompt(chat=(ChatMessage(...), ...)) rendered with the model's chat template, then tokenized
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import jinja2

from pdserve.tokenizer import Tokenizer

MAX_MESSAGES = 4096  # messages in a chat


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Prompt:
    """Exactly one of ``text``, ``token_ids`` and ``chat`` is set; ``encode`` checks it."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if self.chat is not None and len(self.chat) > MAX_MESSAGES:
            raise ValueError(
                f"chat has {len(self.chat)} messages; at most {MAX_MESSAGES} are allowed"
            )


# Longer texts are tokenized off the event loop (the gateway's other requests go on meanwhile).
LONG_TEXT_CHARS = 16_384


def max_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """More characters than this cannot fit ``max_model_len`` tokens, whatever they say."""
    return max_model_len * tokenizer.max_token_chars


def prompt_chars(prompt: Prompt) -> int:
    if prompt.text is not None:
        return len(prompt.text)
    return sum(len(m.content) + len(m.role) for m in prompt.chat or ())


async def encode_async(
    prompt: Prompt, tokenizer: Tokenizer, max_chars: int | None = None
) -> tuple[list[int], str | None]:
    """``encode``, in a thread (releasing the GIL) when the text is long."""
    if prompt_chars(prompt) <= LONG_TEXT_CHARS:
        return encode(prompt, tokenizer, max_chars)
    return await asyncio.to_thread(encode, prompt, tokenizer, max_chars, True)


def encode(
    prompt: Prompt, tokenizer: Tokenizer, max_chars: int | None = None, release_gil: bool = False
) -> tuple[list[int], str | None]:
    """The prompt's token ids, and the text they encode (None for token ids).

    Raises ValueError when no prompt or more than one is set, the text is empty or longer than
    ``max_chars`` (checked before it is tokenized), the chat has no messages, or the chat template
    refuses them. Token ids are taken as they are: what they must satisfy is
    ``validation.validate_prompt``'s to say.
    """
    kinds = [k for k in ("text", "token_ids", "chat") if getattr(prompt, k) is not None]
    if not kinds:
        raise ValueError("no prompt: set one of text, token_ids or chat")
    if len(kinds) > 1:
        raise ValueError(f"set one prompt, not {' and '.join(kinds)}")
    if prompt.text is not None:
        if not prompt.text:
            raise ValueError("prompt is empty; give a non-empty text")
        _check_chars(len(prompt.text), max_chars, tokenizer)
        return tokenizer.encode(prompt.text, release_gil=release_gil), prompt.text
    if prompt.token_ids is not None:
        return list(prompt.token_ids), None
    if not prompt.chat:
        raise ValueError("chat has no messages")
    _check_chars(prompt_chars(prompt), max_chars, tokenizer)
    messages = [{"role": m.role, "content": m.content} for m in prompt.chat]
    try:
        text = tokenizer.apply_chat_template(messages)
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None
    # the template writes the special tokens (BOS and the like) itself
    return tokenizer.encode(text, add_special_tokens=False, release_gil=release_gil), text


def _check_chars(n: int, max_chars: int | None, tokenizer: Tokenizer) -> None:
    if max_chars is not None and n > max_chars:
        raise ValueError(
            f"prompt has {n} characters: more than the model's context can hold in any "
            f"tokenization (at most {max_chars}: no token stands for more than "
            f"{tokenizer.max_token_chars} characters)"
        )
