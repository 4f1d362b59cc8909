"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pdserve.config import DTYPES, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.model.fetch import DEFAULT_MODEL
from pdserve.outputs import RequestOutput, TokenLogprobs
from pdserve.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str = "cpu",
        threads: int | None = None,
        seed: int = 0,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        kv_cache_dtype: str | None = None,
    ) -> None:
        """``kv_cache_dtype``: the KV cache's dtype, as ``CacheConfig.kv_cache_dtype`` ("auto":
        the model's ``dtype``, or bf16 under a float32 model with quantized weights on the CPU;
        "bfloat16" under any float32 model on the CPU); given here, it sets that of ``cache``."""
        cache = cache or CacheConfig()
        if kv_cache_dtype is not None:
            same = DTYPES.get(cache.kv_cache_dtype) == DTYPES.get(kv_cache_dtype, kv_cache_dtype)
            if cache.kv_cache_dtype != "auto" and not same:
                raise ValueError(
                    f"kv_cache_dtype={kv_cache_dtype!r} and cache.kv_cache_dtype="
                    f"{cache.kv_cache_dtype!r} disagree; give one"
                )
            cache = dataclasses.replace(cache, kv_cache_dtype=kv_cache_dtype)
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                quantization=quantization,
                device=device,
                threads=threads,
                seed=seed,
                cache=cache,
                scheduler=scheduler or SchedulerConfig(),
            )
        )
        self.tokenizer = self.engine.tokenizer

    def chat_prompt(self, user_message: str, system: str | None = None) -> str:
        """The prompt text for one user turn, through the model's chat template."""
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ValueError("this model has no chat template; pass the prompt as raw text")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_message}
        ]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def generate_stream(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, delta) as tokens are produced; all prompts run batched.

        All prompts are validated before any runs; an early exit from the loop aborts the rest.
        """
        params_list = self._params_for(prompts, params)
        ids = []
        try:
            for prompt, p in zip(prompts, params_list, strict=True):
                ids.append(self.engine.add_request(self._tokens(prompt), p))
            index = {rid: i for i, rid in enumerate(ids)}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    yield index[out.request_id], out
        finally:
            for rid in ids:
                self.engine.abort_request(rid)

    def generate(
        self,
        prompts: Sequence[str | list[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        token_ids = [self._tokens(p) for p in prompts]
        results = [CompletionOutput(ids) for ids in token_ids]
        for i, out in self.generate_stream(token_ids, params):
            r = results[i]
            r.token_ids += out.new_token_ids
            r.text += out.new_text
            r.logprobs += out.new_logprobs
            r.finish_reason = out.finish_reason
        return results

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        return self.engine.encode(prompt)

    @staticmethod
    def _params_for(prompts, params) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)
