"""The OpenAI API's request and response bodies <-> the gateway's types (no HTTP here).

A request body (parsed JSON) becomes a ``Request``: the model, a ``Prompt`` and ``SamplingParams``,
or a ``RequestError`` (a ValueError: 400) naming the field it refuses. The gateway's ``Delta``s
become the response objects and stream chunks of /v1/completions and /v1/chat/completions.

What is accepted: ``model``, ``prompt`` (a string or token ids; a batch of one), ``messages``
(text content), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``logprobs`` / ``top_logprobs``, ``stream``,
``stream_options.include_usage``, ``n`` (1 only), ``ignore_eos``, ``user`` (the affinity key:
requests of one user go to the same prefill worker, whose prefix cache holds their history).
Fields of the API this server does not implement are refused unless they hold their default
(``presence_penalty: 0`` passes); other unknown fields (``metadata``, ...) are ignored, as OpenAI's server does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.services.gateway.calls import Delta
from pdserve.services.gateway.prompt import ChatMessage, Prompt

from pdserve.outputs import TokenLogprobs
from pdserve.rpc import MAX_MESSAGE_BYTES
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

# The limits on what a request holds are the gRPC API's: SamplingParams' (pdserve/sampling_params.py),
# the prompt's (prompt.py, pdserve/validation.py), and a body no larger than a gRPC message.
MAX_BODY_BYTES = MAX_MESSAGE_BYTES
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Implemented nowhere here: accepted only at the value that means "off".
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


class RequestError(ValueError):
    """A request the API refuses (HTTP 400); ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Request:
    model: str
    prompt: Prompt
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool  # chat without a limit: the rest of the context (the handler sets it)
    affinity_key: str = ""  # the body's ``user``: routed by (GatewayConfig.affinity_slack_s)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict, name: str, check, what: str, default: Any = None) -> Any:
    """``body[name]`` (``default`` when absent or null) if ``check`` accepts it, else RequestError."""
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise RequestError(f"{name} must be {what}, got {v!r:.80}", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    """The JSON shape only; how many and how long is SamplingParams' to say."""
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop must be a string or a list of strings, got {v!r:.80}", "stop")
    return tuple(stops)


def _value(body: dict, name: str, default: Any) -> Any:
    """``body[name]``, ``default`` when absent or null; its type and range are SamplingParams'
    to check."""
    v = body.get(name)
    return default if v is None else v


def _common(body: dict, chat: bool) -> dict[str, Any]:
    """What both endpoints take: the sampling fields, n, stream, stream_options."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, defaults in _UNSUPPORTED_DEFAULTS.items():
        if name in body and body[name] not in defaults:
            raise RequestError(f"{name} is not supported by this server", name)
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise RequestError(f"n must be 1 (one choice per request) on this server, got {n}", "n")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", "")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = _get(
        options,
        "include_usage",
        lambda v: isinstance(v, bool),
        "a boolean",
        False,
    )
    max_tokens = body.get("max_tokens")
    if chat:
        max_tokens = _value(body, "max_completion_tokens", max_tokens)
    if chat:
        want = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
        top = _get(body, "top_logprobs", _is_int, "an integer")
        if top is not None and not want:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
        logprobs_param = "top_logprobs"
    else:
        logprobs = body.get("logprobs")
        logprobs_param = "logprobs"
    top_k = _value(body, "top_k", 0)
    fields = dict(
        max_tokens=max_tokens,
        temperature=_value(body, "temperature", 1.0),
        top_p=_value(body, "top_p", 1.0),
        top_k=0 if _is_int(top_k) and top_k == -1 else top_k,  # -1: off, as vLLM spells it
        seed=body.get("seed"),
        stop=_stop(body),
        ignore_eos=_value(body, "ignore_eos", False),
        logprobs=logprobs,
    )
    return {
        "model": model,
        "user": _get(body, "user", lambda v: isinstance(v, str), "a string", ""),
        "stream": stream,
        "include_usage": include_usage,
        "sampling": fields,
        # the request's name of the fields that have two
        "params": {
            "max_tokens": "max_completion_tokens"
            if chat and body.get("max_completion_tokens") is not None
            else "max_tokens",
            "logprobs": logprobs_param,
        },
    }


def _params(common: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    fields = dict(common["sampling"])
    if fields["max_tokens"] is None:
        fields["max_tokens"] = default_max_tokens
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        # SamplingParams' messages start with the field's name: told as the request names it
        first, _, rest = str(e).partition(" ")
        if first not in fields:
            raise RequestError(str(e)) from None
        param = common["params"].get(first, first)
        raise RequestError(f"{param} {rest}", param) from None


def parse_completion(body: Any) -> Request:
    common = _common(body, chat=False)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        prompt = Prompt(text=p)
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompt = Prompt(token_ids=tuple(p))
    elif isinstance(p, list) and p and all(isinstance(t, str | list) for t in p):
        raise RequestError("prompt: one prompt per request (a batch of one at most)", "prompt")
    else:
        raise RequestError(
            f"prompt must be a non-empty string or a list of token ids, got {p!r:.80}", "prompt"
        )
    return Request(
        common["model"],
        prompt,
        _params(common, COMPLETION_DEFAULT_MAX_TOKENS),
        common["stream"],
        common["include_usage"],
        max_tokens_given=True,
        affinity_key=common["user"],
    )


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported", "messages"
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: a text part needs text", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of parts", "messages")


def parse_chat(body: Any, default_max_tokens: int) -> Request:
    """``default_max_tokens`` stands in for an absent max_tokens until the handler knows the
    prompt's length (``max_tokens_given`` is False then)."""
    common = _common(body, chat=True)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of messages", "messages")
    chat = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
        chat.append(ChatMessage(m["role"], _content(i, m.get("content"))))
    try:
        prompt = Prompt(chat=tuple(chat))
    except ValueError as e:
        raise RequestError(str(e), "messages") from None
    return Request(
        common["model"],
        prompt,
        _params(common, default_max_tokens),
        common["stream"],
        common["include_usage"],
        max_tokens_given=common["sampling"]["max_tokens"] is not None,
        affinity_key=common["user"],
    )


# ---- responses ----


def now() -> int:
    return int(time.time())


def usage(d: Delta) -> dict[str, Any]:
    u = d.usage
    assert u is not None
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        # OpenAI's field for prompt tokens served from a prompt cache (Usage.cached_prompt_tokens)
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tok: Tokenizer, lps: Sequence[TokenLogprobs], offset: int
) -> dict[str, list]:
    """The completions API's logprobs object; ``offset``: characters of text before these tokens."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for lp in lps:
        text = _token_text(tok, lp.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_token_text(tok, t): v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_token(tok: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tok, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tok: Tokenizer, lps: Sequence[TokenLogprobs]) -> dict[str, list]:
    return {
        "content": [
            _chat_token(tok, lp.token_id, lp.logprob)
            | {"top_logprobs": [_chat_token(tok, t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def model_list(name: str, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "max_model_len": max_model_len,
            }
        ],
    }


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
