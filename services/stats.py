"""What a worker reports about itself (Stats RPC, heartbeats)."""

from __future__ import annotations

import dataclasses

from pdserve.engine import LLMEngine
from pdserve.v1 import worker_pb2


def worker_stats(engine: LLMEngine) -> worker_pb2.WorkerStats:
    """The engine's counts (``LLMEngine.stats``) as the Stats RPC's message."""
    return worker_pb2.WorkerStats(**dataclasses.asdict(engine.stats()))
