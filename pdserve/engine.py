"""LLMEngine: one step is schedule -> run -> postprocess."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, KeysView
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.exceptions import AdmissionError
from pdserve.kv_cache.allocator import BlockAllocator
from pdserve.kv_connector import HeldBlocks, KVLanding, KVSender, OutgoingKV, PrefillConnector
from pdserve.model.config import ModelConfig
from pdserve.model.fetch import resolve_model
from pdserve.outputs import RequestOutput, TokenLogprobs
from pdserve.roofline import StepWork
from pdserve.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import Scheduler, blocks_needed
from pdserve.sequence import Sequence
from pdserve.text import TextStream
from pdserve.tokenizer import Tokenizer
from pdserve.validation import validate_prompt


@dataclass(frozen=True)
class EngineStats:
    """What a worker reports about its engine (Stats RPC, metrics, tests' leak checks)."""

    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int  # queued, or (decode) reserved and waiting for its KV
    outstanding_tokens: int  # prompt + max_tokens not yet generated, of every request here


class LLMEngine:
    """Serves offline (``add_request`` + ``step``) and as either half of a disaggregated pair:

    - prefill worker: ``add_prefill`` with the request's ``KVSender``; ``step`` ships each layer
      of a completed prompt as soon as the forward has written it, then the first token;
      ``release_held`` once a transfer that read the pools is over;
    - decode worker: ``reserve_request`` (blocks for the whole request) returns where the prompt's
      KV must land; once it has, ``activate_request`` with the first token.

    Both halves go through the KV connector (kv_connector.py): services never touch blocks.

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
        self.dtype = config.torch_dtype  # the activations'
        self.runner = ModelRunner(
            folder,
            self.model_config,
            config.cache,
            self.dtype,
            torch.device(config.device),
            self.max_model_len,
            config.quantization,
            config.scheduler.max_num_seqs,
            config.kv_torch_dtype,
        )
        self.kv_dtype = self.runner.pool.dtype  # the KV pools' (--kv-cache-dtype, auto resolved)
        self.allocator = BlockAllocator(self.runner.pool.num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            self.allocator,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
        )
        self.kv_out = PrefillConnector(self.model_config.num_layers)
        self._held: dict[str, HeldBlocks] = {}
        self._seqs: dict[str, Sequence] = {}
        self._texts: dict[str, TextStream] = {}
        self._ids = itertools.count()
        self.last_step: StepWork | None = None  # the latest step's batch, counted (roofline.py)
        # told each step's token count once it is scheduled; may return a callable to be told of
        # each layer done in that step (EngineLoop: progress marks within long steps)
        self.on_schedule: Callable[[int], Callable[[int], None] | None] | None = None
        self.prefill_token_s = 0.0  # measured by step(); 0 until a prompt was computed
        self._prefill_avg = [0.0, 0.0]  # seconds, tokens

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(
            prompt_token_ids, params.max_tokens, self.max_model_len, self.model_config.vocab_size
        )

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

    def add_prefill(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        sender: KVSender,
        skip_blocks: int = 0,
        decode_idle: bool = False,
    ) -> OutgoingKV:
        """Prefill side: compute the prompt and sample its first token; each layer's KV leaves
        through ``sender`` as soon as the forward has written it, the token after sampling. The
        returned record tells the caller, once the request's output arrived, how it went.

        ``skip_blocks``: the prompt's leading blocks the destination already holds (its prefix
        cache); the whole prompt is still computed here, only the blocks after them are sent."""
        self.validate(prompt_token_ids, params)  # the whole request must fit where it decodes
        needed = blocks_needed(len(prompt_token_ids), self.scheduler.block_size)
        if not 0 <= skip_blocks < needed:
            raise ValueError(
                f"destination holds {skip_blocks} of the prompt's {needed} blocks already; it "
                f"may hold 0 to {needed - 1} (the block with the last prompt token is always sent)"
            )
        if sender.num_blocks != needed - skip_blocks:
            raise ValueError(
                f"destination has {sender.num_blocks} blocks; the prompt fills {needed}"
                + (f", {skip_blocks} of them held there already" if skip_blocks else "")
            )
        one = dataclasses.replace(params, max_tokens=1, stop=())
        self.add_request(prompt_token_ids, one, request_id)
        self._seqs[request_id].decode_idle = decode_idle
        return self.kv_out.add(request_id, sender, skip_blocks)

    def add_warm(self, prompt_token_ids: list[int], request_id: str) -> None:
        """Prefill side: compute ``prompt_token_ids`` only to leave their KV in the prefix cache
        (a chat's reply, which its decode worker generated: the next turn sends it again), in
        steps that compute no other prompt (``Scheduler._schedule_warm``). Its output is its
        one sampled token, finished; nothing is sent."""
        one = SamplingParams(max_tokens=1)
        self.validate(prompt_token_ids, one)
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_token_ids), one, warm=True)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        self._texts[request_id] = TextStream(None, seq.prompt_token_ids, ())

    def release_held(self, request_id: str) -> None:
        """The transfer that read a finished request's blocks is over: free them (idempotent)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.allocator.free(held.block_ids)

    def reserve_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> KVLanding:
        """Decode side: reserve KV for the whole request; returns where the prompt's KV lands
        (the prompt's blocks after the leading ones this engine's prefix cache already holds).

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
        landing = self._landing_blocks(seq)
        pools = self.runner.pool.kv_caches
        return KVLanding(
            request_id,
            landing,
            tuple(k for k, _ in pools),
            tuple(v for _, v in pools),
            self.allocator.generation_of(landing[0]),
            num_cached_blocks=seq.num_cached_tokens // self.scheduler.block_size,
        )

    def _landing_blocks(self, seq: Sequence) -> tuple[int, ...]:
        """A reserved request's blocks that its prompt's KV lands in: the prompt's blocks after
        those shared from the prefix cache (at least one: the cache leaves the last token out).

            block_table  | cached (shared) | landing (fresh)      | rest of max_tokens |
                         0                 num_cached_blocks      prompt blocks
        """
        first = seq.num_cached_tokens // self.scheduler.block_size
        end = blocks_needed(seq.num_prompt_tokens, self.scheduler.block_size)
        return tuple(seq.block_table[first:end])

    def hold_landing(self, request_id: str) -> None:
        """Decode side, before ``abort_request``: keep the reservation's landing blocks allocated
        (as ``HeldBlocks``) because a write of its failed transfer may still land in them; freed
        by ``release_held`` once the transfer has settled. Shared prefix blocks are never
        written by a transfer, so they are freed with the request."""
        seq = self._seqs.get(request_id)
        if seq is None or request_id in self._held:
            return
        held = HeldBlocks(request_id, self._landing_blocks(seq))
        self.allocator.retain(held.block_ids)
        self._held[request_id] = held

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
            self._finish(seq, "abort")

    def requests_in_flight(self) -> KeysView[str]:
        """Ids of the requests this engine holds (added, not finished or aborted)."""
        return self._seqs.keys()

    def kv_on_its_way(self) -> bool:
        """Decode side: a reserved request's KV has yet to land here."""
        return bool(self.scheduler.awaiting_kv)

    def prompts_for_idle_decode(self) -> bool:
        """Prefill side: every prompt here is for a decode worker that runs nothing else
        (``add_prefill(decode_idle=True)``)."""
        s = self.scheduler
        seqs = (*s.running, *s.waiting, *s.warming)
        real = [seq for seq in seqs if not seq.warm]  # a warm-up's step borrows nothing
        return all(seq.decode_idle for seq in real) and bool(real or not seqs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One forward of the next batch: schedule -> run -> postprocess. Prompts with a KV sender
        ship each layer while the next computes (``kv_out.on_layer``), their token after sampling."""
        batch = self.scheduler.schedule()
        self.last_step = StepWork.of(batch) if batch else None
        if not batch:
            return []
        layer_done = self.on_schedule(batch.num_tokens) if self.on_schedule is not None else None
        on_layer = _each_layer(self.kv_out.on_layer if self.kv_out else None, layer_done)
        started = time.perf_counter()
        seqs, tokens, logprobs = self.runner.run(batch, on_layer)
        if batch.prefills:
            self._measure_prefill(batch.num_tokens, time.perf_counter() - started)
        self.scheduler.postprocess(batch)
        if self.kv_out:
            self.kv_out.end_step(seqs, tokens)
        return [
            self._append(seq, tok, lp) for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True)
        ]

    def _measure_prefill(self, num_tokens: int, seconds: float) -> None:
        """``prefill_token_s``: seconds per token of steps that computed prompts (what gateways
        estimate prefill times with), as exponential averages of seconds over tokens, so that
        long steps weigh more than short ones, whose fixed cost per step would dominate."""
        avg = self._prefill_avg
        if avg[1] == 0:
            avg[:] = [seconds, num_tokens]
        else:
            avg[0] += 0.2 * (seconds - avg[0])
            avg[1] += 0.2 * (num_tokens - avg[1])
        self.prefill_token_s = avg[0] / avg[1]
        self.scheduler.token_s = self.prefill_token_s

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq.output_token_ids.append(token)
        seq.output_logprobs.append(logprobs)
        text = self._texts[seq.request_id]
        reason = "stop" if text.add(token) else None
        if reason is None and (reason := seq.check_token_stop()) is not None:
            text.flush()  # not cut by a stop string: emit any held-back partial character
        if reason is not None:
            self._finish(seq, reason)
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

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Free a request's blocks, except those its outgoing transfer still reads (held)."""
        held = self.kv_out.request_finished(seq)
        if held is not None:
            self.allocator.retain(held.block_ids)
            self._held[held.request_id] = held
        self.scheduler.finish(seq, reason)

    def stats(self) -> EngineStats:
        """Safe to read from another thread while the engine runs: each number is a plain read,
        consistent enough for load reports; tests read it once the worker is idle."""
        s = self.scheduler
        outstanding = sum(
            q.num_prompt_tokens + q.params.max_tokens - len(q.output_token_ids)
            for q in [*s.running, *s.waiting, *s.awaiting_kv]
        )
        return EngineStats(
            num_total_blocks=self.allocator.num_blocks,
            num_free_blocks=self.allocator.num_free_blocks,
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.awaiting_kv),
            outstanding_tokens=outstanding,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks


def _each_layer(
    on_layer: Callable | None, layer_done: Callable[[int], None] | None
) -> Callable | None:
    """The runner's per-layer hook: the KV connector's (ships the layer), then ``layer_done(i)``
    (the engine loop's progress mark); None when neither wants one (no call per layer)."""
    if layer_done is None:
        return on_layer
    if on_layer is None:
        return lambda batch, i, k, v: layer_done(i)

    def both(batch, i, k, v) -> None:
        on_layer(batch, i, k, v)
        layer_done(i)

    return both
