"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20


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
        object.__setattr__(
            self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
