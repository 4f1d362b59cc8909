"""Text <-> token ids for a Hugging Face model folder, with the `tokenizers` library and jinja2 only.

``Tokenizer`` matches transformers' ``AutoTokenizer`` on ``encode``, ``decode`` and
``apply_chat_template(tokenize=False)`` without importing transformers. ``IncrementalDetokenizer``
turns a stream of generated ids into a stream of text pieces that never split a character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Names of special tokens that transformers passes to chat templates (as strings).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _token_content(value: Any) -> str | None:
    """Special tokens are saved either as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _compile_chat_template(source: str) -> jinja2.Template:
    """The same sandboxed environment transformers renders chat templates in."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson escapes HTML characters, which chat templates must not do
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A model folder's tokenizer: ``tokenizer.json`` plus the settings around it."""

    def __init__(
        self,
        backend: HFTokenizer,
        tokenizer_config: dict[str, Any],
        chat_template: str | None,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._special_tokens = {
            k: tok for k in SPECIAL_TOKEN_KEYS if (tok := _token_content(tokenizer_config.get(k)))
        }
        self._eos_token_ids = eos_token_ids
        self._bos_token_id = bos_token_id

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json`` and the eos ids of the model configs.

        eos ids are the ordered union of generation_config.json, config.json and the tokenizer's
        eos_token, so that generation stops on any of them.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"{folder} has no tokenizer.json; pdserve needs a fast (tokenizers) tokenizer"
            )
        backend = HFTokenizer.from_file(str(tokenizer_file))
        tok_config = {
            **_read_json(folder / "special_tokens_map.json"),
            **_read_json(folder / "tokenizer_config.json"),
        }
        template = tok_config.get("chat_template")
        jinja_file = folder / "chat_template.jinja"  # where transformers >= 4.50 saves it
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def token_id(key: str) -> int | None:
            content = _token_content(tok_config.get(key))
            return None if content is None else backend.token_to_id(content)

        eos: list[int] = []
        for candidate in (
            *_as_ids(gen_config.get("eos_token_id")),
            *_as_ids(model_config.get("eos_token_id")),
            *_as_ids(token_id("eos_token")),
        ):
            if candidate not in eos:
                eos.append(candidate)
        bos = token_id("bos_token")
        if bos is None:
            bos = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        return cls(backend, tok_config, template, tuple(eos), bos)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    def encode(
        self, text: str, add_special_tokens: bool = True, release_gil: bool = False
    ) -> list[int]:
        """``release_gil``: through the batch API, which lets other Python threads run meanwhile
        (single ``encode`` holds the GIL throughout); for long texts encoded off an event loop."""
        if release_gil:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (vocabulary entries, added tokens included;
        a byte-level entry's symbols are bytes, at least as many as the characters they make)."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # clean_up_tokenization_spaces is deliberately not applied: transformers 5 skips it for BPE,
        # and it would make streamed text differ from the text decoded at once.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self._chat_template:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        return _compile_chat_template(self._chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages``, as transformers' ``apply_chat_template(tokenize=False)``."""
        return self._compiled_template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )


# How many tokens before the first new one are decoded with it, so that tokenizers which treat the
# start of a sequence specially (a leading-space strip) see the same context as in a full decode.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams the text of generated ids, emitting each character only once all its bytes arrived.

    Offsets into ``ids`` (prompt context first, then the output):

        ids:   [ ... already emitted ... | last emitted chunk | not yet emitted ]
                                         ^ prefix_offset      ^ read_offset

    Each step decodes ``ids[prefix_offset:]`` and emits what it has beyond ``ids[prefix_offset:read_offset]``,
    unless it ends in U+FFFD (a character whose remaining bytes come with later tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one generated id; return the text that became complete with it (maybe "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: the text still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta
