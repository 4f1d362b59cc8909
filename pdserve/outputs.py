"""What generation returns, per step and per token: plain dataclasses, no torch (clients use them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely alternatives, best first


@dataclass
class RequestOutput:
    """What one step added to one request (streaming deltas); ``finished`` on its last one."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
