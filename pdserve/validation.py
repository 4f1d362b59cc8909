"""What a prompt must satisfy wherever it arrives (the gateway, a worker's engine, the offline
API): one check, so that every entry point refuses the same prompts with the same messages; and
what a client's own request id must be (both of the gateway's APIs).

The sampling parameters' limits are SamplingParams' (pdserve/sampling_params.py); a chat's, the
gateway's Prompt's (services/gateway/prompt.py)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_REQUEST_ID_CHARS = 128  # a client's request id: logs, spans and every response carry it


def validate_prompt(
    prompt_token_ids: Sequence[int], max_tokens: int, max_model_len: int, vocab_size: int
) -> None:
    """Raises ValueError unless the prompt has a token, every id is in the vocabulary, and the
    prompt plus ``max_tokens`` fits the model's context."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty; give at least one token")
    if n + max_tokens > max_model_len:
        raise ValueError(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
            f"exceeds this model's context of {max_model_len} tokens"
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def validate_request_id(request_id: str, name: str = "request_id") -> None:
    """Raises ValueError unless ``request_id`` (a client's own id for its request; empty: none)
    has at most MAX_REQUEST_ID_CHARS characters, all printable. ``name``: what the client calls
    it, for the message."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(
            f"{name} has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    if not request_id.isprintable():
        raise ValueError(
            f"{name} {request_id!r} has a character that is not printable; "
            "only printable characters are allowed"
        )
