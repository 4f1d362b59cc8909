"""Thin grpc.aio adapters of the gateway: the public Generation API and the worker Registry."""

from __future__ import annotations

import grpc
from pdserve.services.gateway.accounting import GatewayRequest
from pdserve.services.gateway.gateway import Gateway, GatewayError
from pdserve.services.gateway.registry import LayoutMismatchError, WorkerRegistry

from pdserve import telemetry
from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.v1.convert import logprobs_to_proto, sampling_from_proto


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Each call is one ``GatewayRequest`` (span, logs, metrics), closed with the status the
    client gets: OK, the GatewayError's code, or CANCELLED when the client went away."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _prepare(self, request: generation_pb2.GenerateRequest, req: GatewayRequest):
        gw = self.gateway
        try:
            if request.model and request.model != gw.model_name:
                raise GatewayError(
                    grpc.StatusCode.NOT_FOUND,
                    f"model {request.model!r} is not served here; available: {gw.model_name!r}",
                )
            params = sampling_from_proto(request.sampling)
            kind = request.WhichOneof("prompt")
            text = None
            if kind == "text":
                if not request.text:
                    raise ValueError("prompt is empty; give a non-empty text")
                text = request.text
                ids = gw.tokenizer.encode(text)
            elif kind == "token_ids":
                ids = list(request.token_ids.ids)
            elif kind == "chat":
                if not request.chat.messages:
                    raise ValueError("chat has no messages")
                messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                text = gw.tokenizer.apply_chat_template(messages)
                ids = gw.tokenizer.encode(text, add_special_tokens=False)
            else:
                raise ValueError("no prompt: set one of text, token_ids or chat")
            req.prepared(ids, params.max_tokens, text)
            gw.validate(ids, params)
        except ValueError as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return ids, params

    async def Generate(self, request, context):
        req = self.gateway.open(request.request_id, context.invocation_metadata(), stream=True)
        outcome: tuple[grpc.StatusCode, str] | None = (
            grpc.StatusCode.CANCELLED,
            "the client went away",
        )
        try:
            ids, params = self._prepare(request, req)
            completion = 0
            async for d in self.gateway.generate(req, ids, params, context.time_remaining()):
                completion += len(d.token_ids)
                resp = generation_pb2.GenerateResponse(
                    request_id=req.request_id,
                    token_ids=d.token_ids,
                    text=d.text,
                    logprobs=[logprobs_to_proto(lp) for lp in d.logprobs],
                    finish_reason=d.finish_reason,
                )
                if d.finish_reason:
                    resp.usage.CopyFrom(
                        generation_pb2.Usage(prompt_tokens=len(ids), completion_tokens=completion)
                    )
                    outcome = None
                yield resp
        except GatewayError as e:
            outcome = (e.code, str(e))
            await context.abort(e.code, str(e))
        finally:
            req.close(*outcome) if outcome else req.close()

    async def Complete(self, request, context):
        req = self.gateway.open(request.request_id, context.invocation_metadata(), stream=False)
        outcome: tuple[grpc.StatusCode, str] | None = (
            grpc.StatusCode.CANCELLED,
            "the client went away",
        )
        try:
            ids, params = self._prepare(request, req)
            resp = generation_pb2.CompleteResponse(request_id=req.request_id)
            async for d in self.gateway.generate(req, ids, params, context.time_remaining()):
                resp.token_ids.extend(d.token_ids)
                resp.text += d.text
                resp.logprobs.extend(logprobs_to_proto(lp) for lp in d.logprobs)
                resp.finish_reason = d.finish_reason
            resp.usage.CopyFrom(
                generation_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(resp.token_ids))
            )
            outcome = None
            return resp
        except GatewayError as e:
            outcome = (e.code, str(e))
            await context.abort(e.code, str(e))
        finally:
            req.close(*outcome) if outcome else req.close()

    async def ListModels(self, request, context):
        gw = self.gateway
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=gw.model_name, max_model_len=gw.max_model_len)]
        )


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def Register(self, request: worker_pb2.RegisterRequest, context):
        try:
            self.registry.register(
                request.worker_id, request.role, request.address, request.layout.compat_hash
            )
        except LayoutMismatchError as e:
            telemetry.logger().warning(
                "worker.refused", worker_id=request.worker_id, address=request.address, error=str(e)
            )
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        telemetry.logger().info(
            "worker.registered",
            worker_id=request.worker_id,
            role=request.role,
            address=request.address,
        )
        return worker_pb2.RegisterResponse(lease_ms=int(self.registry.lease_s * 1000))

    async def Heartbeat(self, request: worker_pb2.HeartbeatRequest, context):
        return worker_pb2.HeartbeatResponse(known=self.registry.heartbeat(request.worker_id))
