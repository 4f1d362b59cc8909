"""What a worker reports about itself (Stats RPC)."""

from __future__ import annotations

import dataclasses

from pdserve.engine_loop import EngineLoop
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
