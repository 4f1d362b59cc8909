"""What the gateway reads from its calls to workers: token chunks, and a worker's failure as
``WorkerFailed`` (the request goes on elsewhere) or the caller's own cancellation; and what it
hands its callers: ``Delta``s, the last with the ``Usage``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from pdserve.services.gateway.registry import Worker

from pdserve.outputs import TokenLogprobs
from pdserve.v1 import worker_pb2
from pdserve.v1.convert import logprobs_from_proto


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # prompt tokens the worker that computed the prompt took from its prefix cache (whole blocks)
    cached_prompt_tokens: int = 0


@dataclass
class Delta:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage | None = None  # on the last delta
    received_at: float = 0.0  # time.perf_counter() when its worker message arrived


def chunk(c: worker_pb2.TokenChunk, num_cached: int):
    """What a worker stream yields: token ids, their logprobs, the finish reason, and the prompt
    tokens the worker that computed the prompt took from its prefix cache."""
    return (
        list(c.token_ids),
        [logprobs_from_proto(p) for p in c.logprobs],
        c.finish_reason,
        num_cached,
    )


class WorkerFailed(Exception):
    """A worker failed a call (``worker`` None: unknown which); ``code``: its gRPC status."""

    def __init__(
        self, worker: Worker | None, message: str, code: grpc.StatusCode | None = None
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.code = code


async def read(call, worker: Worker, generated: list[int] | None = None):
    """The messages of ``call`` to ``worker``; the token ids they carry are added to
    ``generated`` (if given) as they pass."""
    try:
        async for msg in call:
            worker.progressed()
            if generated is not None and msg.HasField("tokens"):
                generated += msg.tokens.token_ids
            yield msg
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
        raise call_failed(worker, e) from None


def call_failed(worker: Worker, e: BaseException) -> BaseException:
    """What a call to ``worker`` that raised ``e`` (an RPC error, or cancelled) means."""
    if isinstance(e, grpc.aio.AioRpcError):
        return WorkerFailed(
            worker, f"{worker.role} worker {worker.address}: {e.details()}", e.code()
        )
    return evicted(worker)


def evicted(worker: Worker) -> BaseException:
    """What a call the gateway cancelled becomes: the worker failed, when it was evicted (the
    request goes on elsewhere); the cancellation itself otherwise (the client went away)."""
    task = asyncio.current_task()
    if worker.evicted is None or (task is not None and task.cancelling()):
        return asyncio.CancelledError()
    return WorkerFailed(
        worker,
        f"{worker.role} worker {worker.address} was evicted: {worker.evicted}",
        grpc.StatusCode.UNAVAILABLE,
    )
