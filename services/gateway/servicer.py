"""Thin grpc.aio adapters of the gateway: the public Generation API and the worker Registry."""

from __future__ import annotations

import grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.convert import logprobs_to_proto, sampling_from_proto
from services.gateway.gateway import Gateway, GatewayError
from services.gateway.registry import LayoutMismatchError, WorkerRegistry


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _prepare(self, request: generation_pb2.GenerateRequest, context):
        gw = self.gateway
        try:
            if request.model and request.model != gw.model_name:
                raise _NotFound(f"model {request.model!r} is not served here; available: {gw.model_name!r}")
            params = sampling_from_proto(request.sampling)
            kind = request.WhichOneof("prompt")
            if kind == "text":
                if not request.text:
                    raise ValueError("prompt is empty; give a non-empty text")
                ids = gw.tokenizer.encode(request.text)
            elif kind == "token_ids":
                ids = list(request.token_ids.ids)
            elif kind == "chat":
                if not request.chat.messages:
                    raise ValueError("chat has no messages")
                messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                ids = gw.tokenizer.encode(gw.tokenizer.apply_chat_template(messages), add_special_tokens=False)
            else:
                raise ValueError("no prompt: set one of text, token_ids or chat")
            gw.validate(ids, params)
        except _NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return request.request_id or gw.new_request_id(), ids, params

    async def Generate(self, request, context):
        rid, ids, params = await self._prepare(request, context)
        completion = 0
        try:
            async for d in self.gateway.generate(rid, ids, params, context.time_remaining()):
                completion += len(d.token_ids)
                resp = generation_pb2.GenerateResponse(
                    request_id=rid, token_ids=d.token_ids, text=d.text,
                    logprobs=[logprobs_to_proto(lp) for lp in d.logprobs], finish_reason=d.finish_reason)
                if d.finish_reason:
                    resp.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=len(ids), completion_tokens=completion))
                yield resp
        except GatewayError as e:
            await context.abort(e.code, str(e))

    async def Complete(self, request, context):
        rid, ids, params = await self._prepare(request, context)
        resp = generation_pb2.CompleteResponse(request_id=rid)
        try:
            async for d in self.gateway.generate(rid, ids, params, context.time_remaining()):
                resp.token_ids.extend(d.token_ids)
                resp.text += d.text
                resp.logprobs.extend(logprobs_to_proto(lp) for lp in d.logprobs)
                resp.finish_reason = d.finish_reason
        except GatewayError as e:
            await context.abort(e.code, str(e))
        resp.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(resp.token_ids)))
        return resp

    async def ListModels(self, request, context):
        gw = self.gateway
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=gw.model_name, max_model_len=gw.max_model_len)])


class _NotFound(Exception):
    pass


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def Register(self, request: worker_pb2.RegisterRequest, context):
        try:
            self.registry.register(request.worker_id, request.role, request.address, request.layout.compat_hash)
        except LayoutMismatchError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return worker_pb2.RegisterResponse(lease_ms=int(self.registry.lease_s * 1000))

    async def Heartbeat(self, request: worker_pb2.HeartbeatRequest, context):
        return worker_pb2.HeartbeatResponse(known=self.registry.heartbeat(request.worker_id))
