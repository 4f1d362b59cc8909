"""Continuous batching at iteration level, with chunked prefill and admission by reservation.

Each step: every decoding sequence gets one token, the rest of the token budget goes to prompt
chunks. Which prompts first is ``SchedulerConfig.prompt_order``: "arrival" continues the running
prefills and then admits waiting requests first come, first served; "shortest" (the default)
gives it to the prompts with the fewest tokens left to compute, running or waiting, a waiting or
passed-over prompt counted shorter by the tokens the engine computes in 1 / PROMPT_AGING of the
time it has waited (so it is passed over by later prompts for at most ~PROMPT_AGING times its own
compute time). One long prompt then no longer holds every short one behind it for its whole
compute time, which is what set the time to first token of a mix of chat turns and documents
(docs/benchmarks.md, "Shortest prompts first"). A request is admitted only
when blocks for its whole lifetime (prompt + max_tokens - 1) can be allocated, so no running
request ever runs out of KV mid-decode and nothing is ever evicted. A request whose next
uncached prompt block a running prefill is computing (or, on a decode worker, a transfer is
bringing) waits for it, keeping its place (those behind it that do not wait go ahead), rather
than computing the same prefix again beside it: chat sessions that share a system prompt and
arrive together compute it once.

Warm-ups (``Sequence.warm``: a prompt computed only to leave its KV in the prefix cache) wait in
their own queue and run only in steps that compute no other prompt, ``WARM_CHUNK`` tokens at a
time: a request that arrives meanwhile waits for one such step at most.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.config import PROMPT_AGING, SchedulerConfig
from pdserve.kv_cache.allocator import BlockAllocator, prefix_block_hashes
from pdserve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new prompt tokens)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


DEFAULT_TOKEN_S = 1e-3  # seconds per prompt token that age waiting prompts until one is measured
WARM_CHUNK = 32  # prompt tokens of warm-ups per step: what a request arriving meanwhile waits for


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def pending_hashes(seqs, block_size: int) -> set[bytes]:
    """The hashes of the full prompt blocks that these sequences have yet to compute or, awaiting
    their KV, to receive (each is registered, and so found by ``lookup``, once there). Not a
    warm-up's: it may wait behind other prompts, so a request computes such a prefix itself."""
    out: set[bytes] = set()
    for s in seqs:
        if s.in_prefill and not s.warm:
            out.update(s.block_hashes[s.num_computed_tokens // block_size :])
    return out


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: list[Sequence] = []
        self.warming: deque[Sequence] = deque()  # warm-ups not yet admitted (FCFS among them)
        # seconds per prompt token, as the engine measures them (LLMEngine._measure_prefill):
        # how "shortest" ages a prompt that waits; DEFAULT_TOKEN_S until then
        self.token_s = 0.0

    def add(self, seq: Sequence) -> None:
        needed = blocks_needed(seq.max_kv_tokens, self.block_size)
        if needed > self.allocator.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({seq.max_kv_tokens} tokens) but the whole cache has "
                f"{self.allocator.num_blocks}; lower max_tokens or enlarge the KV cache"
            )
        if self.enable_prefix_caching:
            seq.block_hashes = prefix_block_hashes(seq.prompt_token_ids, self.block_size)
        (self.warming if seq.warm else self.waiting).append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.warming)

    @property
    def num_seats_taken(self) -> int:
        return len(self.running) + len(self.awaiting_kv)

    def reserve(self, seq: Sequence) -> bool:
        """Decode worker admission: blocks for the whole request, or False at once. It never waits,
        nor takes a seat or blocks that a request already waiting here needs (``_needed_by_waiting``).

        With prefix caching, the prompt's leading full blocks that this worker already holds
        (``seq.num_cached_tokens``) are shared, not allocated: only the rest of the prompt's KV
        has to arrive. The sequence then waits, outside the batch, for it (``activate``).
        """
        seats, blocks = self._needed_by_waiting()
        if self.num_seats_taken + seats >= self.config.max_num_seqs:
            return False
        if self.enable_prefix_caching:
            seq.block_hashes = prefix_block_hashes(seq.prompt_token_ids, self.block_size)
        if not self._allocate(seq):
            return False
        if not self.allocator.can_allocate(blocks):
            self.allocator.free(seq.block_table)  # it would take blocks a waiting request needs
            seq.block_table = []
            return False
        seq.status = SequenceStatus.AWAITING_KV
        self.awaiting_kv.append(seq)
        return True

    def activate(self, seq: Sequence) -> None:
        """The prompt's KV has landed: the sequence joins the running batch, decoding. Its full
        prompt blocks become findable by later reservations (they are never written again)."""
        self.awaiting_kv.remove(seq)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        for block, block_hash in zip(seq.block_table, seq.block_hashes, strict=False):
            self.allocator.register_hash(block, block_hash)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for seq in self.running:
            if not seq.in_prefill and budget > 0:
                batch.decodes.append(seq)
                budget -= 1
        if self.config.prompt_order == "shortest":
            budget = self._shortest_first(batch, budget)
        else:
            budget = self._in_arrival_order(batch, budget)
        if not batch.prefills:
            self._schedule_warm(batch, min(budget, WARM_CHUNK))
        return batch

    def _in_arrival_order(self, batch: ScheduledBatch, budget: int) -> int:
        """Running prefills' next chunks, then waiting requests first come, first served."""
        budget = self._continue_prefills(batch, budget, warm=False)
        pending = self._pending()
        i = 0  # the first waiting request not waiting for a prefix being computed
        while i < len(self.waiting) and budget > 0 and self._seat_free():
            seq = self.waiting[i]
            if self._waits(seq, pending):
                i += 1  # it keeps its place and reuses the prefix once computed
                continue
            if not self._allocate(seq):
                break  # FCFS: nobody overtakes a request that does not fit
            pending.update(pending_hashes((seq,), self.block_size))
            del self.waiting[i]
            budget = self._admit(batch, seq, budget)
        return budget

    def _shortest_first(self, batch: ScheduledBatch, budget: int) -> int:
        """Running prefills and waiting requests by the tokens they have left to compute, less
        what their wait has earned them (``_left``): chunks of the running ones, the waiting ones
        admitted. Nobody is admitted past a waiting request that does not fit (it would never
        fit while shorter ones keep coming); one waiting for a prefix being computed keeps its
        place and reuses it once computed."""
        now, pending = time.monotonic(), self._pending()
        running = [s for s in self.running if s.in_prefill and not s.warm]
        order = sorted(
            [(self._left(s, now, s.num_prompt_tokens - s.num_computed_tokens), s) for s in running]
            + [(self._left(s, now, self._to_compute(s, pending)), s) for s in self.waiting],
            key=lambda c: c[0],
        )
        admitting = True
        for _, seq in order:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                budget = self._chunk(batch, seq, budget)
            elif admitting and self._seat_free() and not self._waits(seq, pending):
                if not self._allocate(seq):
                    admitting = False
                    continue
                pending.update(pending_hashes((seq,), self.block_size))
                self.waiting.remove(seq)
                budget = self._admit(batch, seq, budget)
        return budget

    def _left(self, seq: Sequence, now: float, tokens: int) -> float:
        """``seq``'s place in "shortest": its ``tokens`` left to compute less those the engine
        computes in 1 / PROMPT_AGING of the time since it arrived."""
        return tokens - (now - seq.arrival) / ((self.token_s or DEFAULT_TOKEN_S) * PROMPT_AGING)

    def _to_compute(self, seq: Sequence, pending: set[bytes]) -> int:
        """Tokens of a waiting prompt to compute: all but its leading blocks cached or being
        computed."""
        return seq.num_prompt_tokens - self._cached_blocks(seq, pending)[0] * self.block_size

    def _schedule_warm(self, batch: ScheduledBatch, budget: int) -> None:
        """Warm-ups, in a step that computes no other prompt: those under way first, then new
        ones while no other request waits (those waiting for a prefix being computed included:
        their blocks come first)."""
        budget = self._continue_prefills(batch, budget, warm=True)
        while self.warming and not self.waiting and budget > 0 and self._seat_free():
            if not self._allocate(self.warming[0]):
                return
            budget = self._admit(batch, self.warming.popleft(), budget)

    def _seat_free(self) -> bool:
        return self.num_seats_taken < self.config.max_num_seqs

    def _continue_prefills(self, batch: ScheduledBatch, budget: int, warm: bool) -> int:
        """The next chunk of each running prefill (of warm-ups, or of requests), within
        ``budget``; returns what is left of it."""
        for seq in self.running:
            if seq.in_prefill and seq.warm == warm and budget > 0:
                budget = self._chunk(batch, seq, budget)
        return budget

    def _admit(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """``seq``, its blocks allocated, joins the running batch with its first chunk."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return self._chunk(batch, seq, budget)

    @staticmethod
    def _chunk(batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        n = min(budget, seq.num_prompt_tokens - seq.num_computed_tokens)
        batch.prefills.append((seq, n))
        return budget - n

    def has_prompt_work(self) -> bool:
        """Whether a prompt waits or is being prefilled (the next step is not decode-only)."""
        return bool(self.waiting or self.warming) or any(s.in_prefill for s in self.running)

    def num_prompt_tokens_to_compute(self) -> int:
        """Prompt tokens still to compute here: the rest of running prefills, and the prompts
        waiting less their leading blocks cached or being computed. Read from another thread
        (heartbeats): works on copies taken in one C-level call each."""
        running = tuple(self.running)
        n = sum(
            s.num_prompt_tokens - s.num_computed_tokens
            for s in running
            if s.in_prefill and not s.warm
        )
        pending = self._pending()
        return n + sum(self._to_compute(seq, pending) for seq in tuple(self.waiting))

    def _needed_by_waiting(self) -> tuple[int, int]:
        """(seats, blocks) that the requests waiting here other than for a prefix being computed
        or received need to be admitted (blocks counted without prefix reuse: at most what they
        take). A reservation that would leave them short overtakes them, and is refused; one that
        leaves both goes ahead: they wait for the step's token budget, not for room."""
        if not self.waiting:
            return 0, 0
        pending = self._pending()
        ahead = [s for s in self.waiting if not self._waits(s, pending)]
        blocks = sum(blocks_needed(s.max_kv_tokens, self.block_size) for s in ahead)
        return len(ahead), blocks

    def _pending(self) -> set[bytes]:
        """``pending_hashes`` of the running prefills and the requests awaiting their KV (from
        copies taken in one C-level call each: heartbeats read it from another thread)."""
        return pending_hashes(tuple(self.running) + tuple(self.awaiting_kv), self.block_size)

    def _waits(self, seq: Sequence, pending: set[bytes]) -> bool:
        """Whether ``seq`` waits for a prefix being computed or received (in ``pending``)."""
        return bool(pending) and self._cached_blocks(seq, pending)[1]

    def _cached_blocks(self, seq: Sequence, pending: set[bytes]) -> tuple[int, bool]:
        """(the leading prompt blocks of ``seq`` that are cached or in ``pending``, whether any
        of them is pending), up to the blocks a prompt may reuse (``_allocate``)."""
        n, waits = 0, False
        for block_hash in seq.block_hashes[: (seq.num_prompt_tokens - 1) // self.block_size]:
            if self.allocator.lookup(block_hash) is None:
                if block_hash not in pending:
                    break
                waits = True
            n += 1
        return n, waits

    def postprocess(self, batch: ScheduledBatch) -> None:
        """After the forward: advance computed counts and publish newly completed prompt blocks."""
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
            for i in range(full):
                self.allocator.register_hash(seq.block_table[i], seq.block_hashes[i])
        for seq in batch.decodes:
            seq.num_computed_tokens += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request (finished, aborted, failed) and free its blocks; idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            (self.warming if seq.warm else self.waiting).remove(seq)
        elif seq.status is SequenceStatus.AWAITING_KV:
            self.awaiting_kv.remove(seq)
        else:
            self.running.remove(seq)
            if self.enable_prefix_caching:
                self._publish_generated(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _publish_generated(self, seq: Sequence) -> None:
        """Make the full blocks past the prompt's findable like prompt blocks: the generated
        tokens' KV (and the prompt's last, partial block with them), as far as it is in the cache
        (``num_computed_tokens``: the last sampled token was never fed back). A chat's next turn
        sends this turn's prompt and reply again, and then finds both here and computes only the
        new message. The hashes chain on from the prompt's, over the tokens in order, so a later
        prompt matches them only where its tokens are these."""
        bs, n = self.block_size, len(seq.block_hashes)
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if full <= n:
            return
        tokens = [*seq.prompt_token_ids[n * bs :], *seq.output_token_ids][: (full - n) * bs]
        parent = seq.block_hashes[-1] if n else None
        for block, block_hash in zip(
            seq.block_table[n:full], prefix_block_hashes(tokens, bs, parent), strict=True
        ):
            self.allocator.register_hash(block, block_hash)

    def _allocate(self, seq: Sequence) -> bool:
        """Blocks for the request's whole lifetime, reusing cached full prompt blocks (all or nothing)."""
        reused: list[int] = []
        # Leave at least one prompt token to compute: its logits give the first output token (on
        # a decode worker: one block to receive, whose transfer carries the first token).
        max_reuse = (seq.num_prompt_tokens - 1) // self.block_size
        for block_hash in seq.block_hashes[:max_reuse]:
            block = self.allocator.take_cached(block_hash)
            if block is None:
                break
            reused.append(block)
        rest = blocks_needed(seq.max_kv_tokens, self.block_size) - len(reused)
        if not self.allocator.can_allocate(rest):
            self.allocator.free(reused)
            return False
        seq.block_table = reused + self.allocator.allocate(rest)
        seq.num_cached_tokens = seq.num_computed_tokens = len(reused) * self.block_size
        return True
