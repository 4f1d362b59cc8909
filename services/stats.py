"""What a worker reports about itself (Stats RPC, heartbeats)."""

from __future__ import annotations

import dataclasses

from pdserve.engine_loop import EngineLoop
from pdserve.kv_cache.prefix_summary import PrefixSummary
from pdserve.v1 import worker_pb2


def worker_stats(loop: EngineLoop) -> worker_pb2.WorkerStats:
    """The engine's counts (``LLMEngine.stats``) and its thread's progress
    (``EngineLoop.progress``) as the Stats RPC's message."""
    progress = loop.progress()
    return worker_pb2.WorkerStats(
        **dataclasses.asdict(loop.engine.stats()),
        engine_steps=progress.num_steps,
        engine_busy_s=progress.busy_s,
        engine_step_predicted_s=progress.predicted_s,
    )


def heartbeat_stats(loop: EngineLoop) -> worker_pb2.WorkerStats:
    """``worker_stats`` and what the gateways route by: the prompt work queued here in seconds,
    the measured seconds per prompt token, and a summary of the prefix cache. Read on the event
    loop while the engine thread runs (each part from a copy taken in one C-level call)."""
    engine = loop.engine
    stats = worker_stats(loop)
    token_s = engine.prefill_token_s
    stats.prefill_token_s = token_s
    stats.prefill_queue_s = engine.scheduler.num_prompt_tokens_to_compute() * token_s
    if engine.scheduler.enable_prefix_caching:  # else none: the gateways expect no cache hit here
        summary = PrefixSummary.build(engine.scheduler.block_size, engine.allocator.cached_hashes())
        stats.prefix_summary.CopyFrom(summary_to_proto(summary))
    return stats


def summary_to_proto(s: PrefixSummary) -> worker_pb2.PrefixSummary:
    return worker_pb2.PrefixSummary(
        block_size=s.block_size, num_hashes=s.num_hashes, num_probes=s.num_probes, bloom=s.bloom
    )
