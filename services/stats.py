"""What a worker reports about itself (Stats RPC, heartbeats)."""

from __future__ import annotations

from pdserve.engine import LLMEngine
from pdserve.v1 import worker_pb2


def worker_stats(engine: LLMEngine) -> worker_pb2.WorkerStats:
    """Read from the event loop while the engine thread runs: each number is a plain int read,
    consistent enough for load reports; tests read it once the worker is idle."""
    s = engine.scheduler
    outstanding = sum(
        q.num_prompt_tokens + q.params.max_tokens - len(q.output_token_ids)
        for q in [*s.running, *s.waiting, *s.awaiting_kv]
    )
    return worker_pb2.WorkerStats(
        num_total_blocks=engine.allocator.num_blocks,
        num_free_blocks=engine.allocator.num_free_blocks,
        num_running=len(s.running),
        num_waiting=len(s.waiting) + len(s.awaiting_kv),
        outstanding_tokens=outstanding,
    )
