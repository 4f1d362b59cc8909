"""One request's state inside an engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.outputs import TokenLogprobs
from pdserve.sampler import SamplerRow
from pdserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    AWAITING_KV = (
        "awaiting_kv"  # decode worker: blocks reserved, prompt KV arriving from a prefill worker
    )
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token bookkeeping for one request.

    positions:  0 ........................ num_computed_tokens ........ num_tokens
                KV already in the cache   | tokens still to run through the model
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full prompt blocks
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    # prefill side: its decode worker runs nothing else (EngineLoop may borrow that one's cores)
    decode_idle: bool = False
    # prefill side: computed only to leave its KV in the prefix cache (a chat's reply, so that
    # the next turn finds it), in steps no other prompt needs (Scheduler: ``warming``)
    warm: bool = False
    # when the engine got it (time.monotonic()): how long it has waited ("shortest" ages it)
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_kv_tokens(self) -> int:
        """KV slots this request can ever need: the last sampled token is never fed back."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    def token_at(self, position: int) -> int:
        n = self.num_prompt_tokens
        return (
            self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
        )

    def sampler_row(self) -> SamplerRow:
        """With a seed, the draws for the next token depend on the seed and the token's position
        alone: whichever worker samples it (the prefill worker the first token, a decode worker
        the rest, another one after a resume whose prompt holds the tokens so far) draws the same."""
        if self.generator is not None:
            self.generator.manual_seed(position_seed(self.params.seed, self.num_tokens))
        return SamplerRow(self.params, self.generator)

    def check_token_stop(self) -> str | None:
        """Finish reason after the newest token, from token ids alone (stop strings are the engine's)."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in self.params.stop_token_ids:
            return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens:
            return "length"
        return None


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A generator seed for sampling the token at ``position`` of a request seeded with ``seed``:
    splitmix64 of the pair, so neighbouring positions and seeds get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # manual_seed takes a non-negative int64
