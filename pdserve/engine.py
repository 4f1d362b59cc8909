"""LLMEngine: one step is schedule -> run -> postprocess."""

from __future__ import annotations

import itertools

import torch

from pdserve.config import EngineConfig
from pdserve.kv_cache.allocator import BlockAllocator
from pdserve.model.config import ModelConfig
from pdserve.model.fetch import resolve_model
from pdserve.outputs import RequestOutput, TokenLogprobs
from pdserve.runner import LayerHook, ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import Scheduler
from pdserve.sequence import Sequence
from pdserve.text import TextStream
from pdserve.tokenizer import Tokenizer


class AdmissionError(RuntimeError):
    """The worker cannot take the request now (KV blocks or seats); another worker may."""


class LLMEngine:
    """Serves offline (``add_request`` + ``step``) and as either half of a disaggregated pair:

    - prefill worker: ``add_request`` with max_tokens=1 and ``step(on_layer=...)`` to ship each
      layer's KV as soon as the forward has written it;
    - decode worker: ``reserve_request`` (blocks for the whole request), then, once the prompt's
      KV has been written into those blocks, ``activate_request`` with the first token.

    ``detokenize=False`` leaves text to the caller (the gateway detokenizes and applies stop strings).
    """

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        folder = resolve_model(config.model)
        self.model_config = ModelConfig.from_file(folder / "config.json")
        # A folder without tokenizer.json still serves token-id prompts (text output is then empty).
        has_tokenizer = detokenize and (folder / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.from_folder(folder) if has_tokenizer else None
        tok_eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids) | set(tok_eos)))
        self.max_model_len = min(
            config.scheduler.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.dtype = config.torch_dtype
        self.runner = ModelRunner(
            folder,
            self.model_config,
            config.cache,
            self.dtype,
            torch.device(config.device),
            self.max_model_len,
        )
        self.allocator = BlockAllocator(self.runner.pool.num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            self.allocator,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
        )
        self._seqs: dict[str, Sequence] = {}
        self._texts: dict[str, TextStream] = {}
        self._ids = itertools.count()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty; give at least one token")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}: {n + params.max_tokens} "
                f"exceeds this model's context of {self.max_model_len} tokens"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise ValueError("prompt is empty; give a non-empty string")
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json; pass prompts as token ids")
        return self.tokenizer.encode(prompt)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        ids = self.encode(prompt)
        self.validate(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, eos_token_ids=self.eos_token_ids)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        self._texts[request_id] = TextStream(self.tokenizer, ids, params.stop)
        return request_id

    def reserve_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[int]:
        """Decode side: reserve KV for the whole request; returns the blocks the prompt's KV goes to.

        Raises AdmissionError at once when the blocks or a batch seat are not free.
        """
        self.validate(prompt_token_ids, params)
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        if not self.scheduler.reserve(seq):
            raise AdmissionError(
                f"decode worker full: {self.allocator.num_free_blocks} KV blocks free, "
                f"{self.scheduler.num_seats_taken}/{self.scheduler.config.max_num_seqs} seats taken"
            )
        self._seqs[request_id] = seq
        self._texts[request_id] = TextStream(self.tokenizer, seq.prompt_token_ids, params.stop)
        num_prompt_blocks = -(-seq.num_prompt_tokens // self.scheduler.block_size)
        return seq.block_table[:num_prompt_blocks]

    def activate_request(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Decode side: the prompt's KV is in the reserved blocks; continue from ``first_token``."""
        seq = self._seqs[request_id]
        self.scheduler.activate(seq)
        return self._append(seq, first_token, logprobs)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._texts.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, on_layer: LayerHook | None = None) -> list[RequestOutput]:
        """One forward of the next batch. ``on_layer(batch, layer, k_cache, v_cache)`` runs after
        each layer has written its KV (the prefill worker ships that layer while the next computes)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        seqs, tokens, logprobs = self.runner.run(batch, on_layer)
        self.scheduler.postprocess(batch)
        return [
            self._append(seq, tok, lp) for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True)
        ]

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq.output_token_ids.append(token)
        seq.output_logprobs.append(logprobs)
        text = self._texts[seq.request_id]
        reason = "stop" if text.add(token) else None
        if reason is None and (reason := seq.check_token_stop()) is not None:
            text.flush()  # not cut by a stop string: emit any held-back partial character
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id], self._texts[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_text=text.take(finished=reason is not None),
            new_logprobs=[logprobs],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks
