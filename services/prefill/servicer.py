"""Thin grpc.aio adapter: protobuf -> PrefillWorker -> protobuf. What it raises ends the call
with the status ``services/errors.py`` gives it."""

from __future__ import annotations

import time

from pdserve.services.prefill.worker import Destination, PrefillWorker
from pdserve.services.stats import worker_stats

from pdserve import telemetry
from pdserve.transfer import HeaderMismatchError
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.v1.convert import logprobs_to_proto, sampling_from_proto


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context
    ) -> worker_pb2.PrefillResponse:
        with self.worker.gate.enter():  # UNAVAILABLE while draining: the gateway tries another
            return await self._prefill(request, context)

    async def _prefill(
        self, request: worker_pb2.PrefillRequest, context
    ) -> worker_pb2.PrefillResponse:
        parent = telemetry.from_metadata(context.invocation_metadata())
        if request.cache_only:
            cached = await self.worker.warm(
                request.request_id, list(request.prompt_token_ids), parent
            )
            return worker_pb2.PrefillResponse(cached_prompt_tokens=cached)
        d = request.destination
        params = sampling_from_proto(request.sampling)
        dest = Destination(
            d.kv_address,
            int(d.transfer_id),
            list(d.block_ids),
            max(d.deadline_unix_ms / 1000 - time.time(), 0.001),
            d.num_cached_blocks,
            request.decode_idle,
        )
        layout = self.worker.transport.layout
        if d.compat_hash and d.compat_hash != layout.compat_hash:
            raise HeaderMismatchError(
                f"decode worker's KV layout {d.compat_hash} differs from this prefill "
                f"worker's {layout.compat_hash} ({layout.describe()}): prefill and decode must "
                "serve the same model, dtype, block size and KV cache dtype (--kv-cache-dtype)"
            )
        out, stats, overlap = await self.worker.prefill(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            dest,
            parent,
        )
        lp = logprobs_to_proto(out.new_logprobs[0]) or None
        first = lp if lp is not None else common_pb2.TokenLogprob(token_id=out.new_token_ids[0])
        return worker_pb2.PrefillResponse(
            first_token=first,
            cached_prompt_tokens=out.num_cached_tokens,
            transfer=worker_pb2.TransferStats(
                bytes=stats.nbytes, seconds=stats.seconds, gbps=stats.gbps, overlap_fraction=overlap
            ),
        )

    async def Stats(self, request, context) -> worker_pb2.WorkerStats:
        return worker_stats(self.worker.loop)
