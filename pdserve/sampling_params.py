"""Per-request sampling parameters, validated on construction.

The limits here are the request's, whichever way it arrives (the gateway's gRPC and HTTP APIs, a
worker's RPCs, the offline API): a value outside them is a ValueError whose message starts with
the field's name, says what was given and what is allowed (the gRPC APIs answer INVALID_ARGUMENT
with it, the HTTP API 400 naming the field).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

MAX_LOGPROBS = 20  # top alternatives per token
MAX_TEMPERATURE = 2.0  # as OpenAI's API
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256  # stop token ids per request
# what the workers' wire format holds (uint32 top_k, int64 seed)
TOP_K_LIMIT = 2**32
SEED_RANGE = (-(2**63), 2**63)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)  # numpy's floats too


def _short(v: object) -> str:
    """``v``'s repr, cut to fit an error message (a request may hold megabytes)."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.

    ``logprobs``: None for none, else the number of top alternatives (0 gives only the chosen token's).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the dataclass is frozen).
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            if name == "stop" and isinstance(v, str):
                v = (v,)
            try:
                object.__setattr__(self, name, tuple(v))
            except TypeError:
                raise ValueError(f"{name} must be a sequence, got {_short(v)}") from None
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {_short(self.max_tokens)}")
        if not (_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(  # (NaN is refused too: it compares false)
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 is greedy), "
                f"got {_short(self.temperature)}"
            )
        if not (_is_int(self.top_k) and 0 <= self.top_k < TOP_K_LIMIT):
            raise ValueError(
                f"top_k must be an integer in [0, 2**32) (0 disables it), got {_short(self.top_k)}"
            )
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {_short(self.top_p)}")
        lo, hi = SEED_RANGE
        if self.seed is not None and not (_is_int(self.seed) and lo <= self.seed < hi):
            raise ValueError(
                f"seed must be None or an integer in [-2**63, 2**63), got {_short(self.seed)}"
            )
        self._check_stop()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {_short(self.ignore_eos)}")
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                f"got {_short(self.logprobs)}"
            )

    def _check_stop(self) -> None:
        stop, ids = self.stop, self.stop_token_ids
        if len(stop) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {_short(s)}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop strings may have at most {MAX_STOP_CHARS} characters, got one of "
                    f"{len(s)}: {_short(s)}"
                )
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        bad = next((t for t in ids if not (_is_int(t) and t >= 0)), None)
        if bad is not None:
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {_short(bad)} among them"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
