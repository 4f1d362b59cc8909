"""Thin grpc.aio adapter: protobuf -> DecodeWorker -> protobuf. What it raises ends the call
with the status ``services/errors.py`` gives it."""

from __future__ import annotations

import contextlib

import grpc
from pdserve.services.decode.worker import DecodeWorker
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.stats import worker_stats

from pdserve import telemetry
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.v1.convert import logprobs_to_proto, sampling_from_proto


def token_chunk(out, cached_prompt_tokens: int = 0) -> worker_pb2.DecodeResponse:
    logprobs = [lp for lp in map(logprobs_to_proto, out.new_logprobs) if lp is not None]
    return worker_pb2.DecodeResponse(
        tokens=worker_pb2.TokenChunk(
            token_ids=out.new_token_ids,
            logprobs=logprobs,
            finish_reason=out.finish_reason or "",
            cached_prompt_tokens=cached_prompt_tokens,
        )
    )


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Generate(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        with self.worker.gate.enter():  # UNAVAILABLE while draining: the gateway tries another
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    yield response

    async def _generate(self, request: worker_pb2.DecodeRequest, context):
        params = sampling_from_proto(request.sampling)
        ids = list(request.prompt_token_ids)
        parent = telemetry.from_metadata(context.invocation_metadata())
        if request.prefill_locally:
            async for out in self.worker.generate_local(request.request_id, ids, params, parent):
                yield token_chunk(out, out.num_cached_tokens)  # computed here: its cache's
            return
        # kv_timeout_ms unset (a caller other than the gateway): the gateway's default
        timeout = (
            request.kv_timeout_ms / 1000 if request.kv_timeout_ms else GatewayConfig.kv_timeout_s
        )
        adm = await self.worker.admit(request.request_id, ids, params, timeout, parent)
        transport = self.worker.transport
        try:
            yield worker_pb2.DecodeResponse(
                admitted=worker_pb2.Admitted(
                    destination=worker_pb2.KVDestination(
                        transfer_id=str(adm.transfer_id),
                        kv_address=transport.address(),
                        block_ids=adm.block_ids,
                        deadline_unix_ms=adm.deadline_unix_ms,
                        compat_hash=transport.layout.compat_hash,
                        num_cached_blocks=adm.num_cached_blocks,
                    )
                )
            )
            async for out in self.worker.stream(adm):
                yield token_chunk(out)
        finally:
            await self.worker.release(adm)  # the caller went away right after admission, or failed

    async def Stats(self, request, context) -> worker_pb2.WorkerStats:
        return worker_stats(self.worker.loop)
