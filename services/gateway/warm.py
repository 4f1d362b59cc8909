"""Warm replies (``--warm-replies``): a finished reply's KV, kept on the prefill worker too.

A chat's next turn sends the whole conversation again: this turn's prompt, its reply, a new
message. The decode worker keeps the reply's blocks (``Scheduler._publish_generated``), but the
prefill worker that computed the prompt never saw the reply, so a disaggregated next turn
computes it there again on the request's critical path. With warm replies the gateway, once a
disaggregated request has ended well, sends that prefill worker the prompt and the reply's full
blocks as a ``cache_only`` prefill: it computes what it lacks (the reply, a few blocks) only in
engine steps that compute no other prompt (``pdserve/scheduler.py``: warm-ups), and the next
turn finds it there and computes just the new message. Best effort: a worker with
``MAX_WARMING`` warm-ups waiting refuses more, and a failure only counts in the metric.

Off by default: it costs a prefill worker's idle time (and cache room) for every reply, which
pays only where replies are sent again (chats) and where the prefill worker's core is its own.
"""

from __future__ import annotations

import asyncio

import grpc
from pdserve.services.gateway import cost as costs
from pdserve.services.gateway.cost import Job
from pdserve.services.gateway.registry import Worker

from pdserve import telemetry
from pdserve.metrics import GatewayMetrics
from pdserve.v1 import worker_pb2

WARM_TIMEOUT_S = 30.0  # a warm-up not done by then is moot: the next turn came, or never will


def warm_tokens(prompt_ids: list[int], generated: list[int], block_size: int) -> list[int]:
    """The tokens to warm a prefill worker with: the prompt and the reply (but its last token:
    its KV was never written) up to their last full block; [] when that adds no full block to
    the prompt's own (the prefill worker holds those: it computed the prompt)."""
    tokens = [*prompt_ids, *generated[:-1]]
    full = len(tokens) // block_size
    if full <= len(prompt_ids) // block_size:
        return []
    return tokens[: full * block_size]


class ReplyWarmer:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def reply_ended(
        self, prefill: Worker, job: Job, generated: list[int], request_id: str, md
    ) -> None:
        """A disaggregated request that ``prefill`` prefilled has ended with ``generated``."""
        size = costs.block_size(prefill)
        tokens = warm_tokens(job.prompt_ids, generated, size)
        if not tokens:
            return
        # the same blocks' hashes, the prompt's as routing already hashed them, then the reply's
        hashes = [*job.hashes(size), *costs.reply_hashes(job, size, generated)]
        warm = self._warm(prefill, tokens, hashes, size, f"{request_id}.warm", md)
        task = asyncio.create_task(warm)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(
        self, prefill: Worker, tokens: list[int], hashes: list[bytes], size: int, rid: str, md
    ) -> None:
        prefill.prompt_cached(hashes, size)  # counted as cached there from now on, as any prompt
        outcome = "failed"
        try:
            await prefill.stub.Prefill(
                worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=tokens, cache_only=True),
                timeout=WARM_TIMEOUT_S,
                metadata=md,
            )
            outcome = "done"
        except Exception as e:  # noqa: BLE001 - best effort: counted and logged, never raised
            if isinstance(e, grpc.aio.AioRpcError):
                refused = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                outcome = "refused" if refused else outcome
            telemetry.logger().debug("gateway.warm_failed", worker=prefill.address, error=str(e))
        finally:
            prefill.prompt_ended(hashes, outcome == "done")
            self.metrics.warm_replies.labels(outcome).inc()

    async def close(self) -> None:
        """Cancel the warm-ups under way (the gateway stops)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
