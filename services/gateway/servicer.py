"""Thin grpc.aio adapters of the gateway: the public Generation API and the worker Registry.

protobuf -> Python (Prompt, SamplingParams) -> Gateway -> protobuf; what they raise ends the call
with the status ``services/errors.py`` gives it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from pdserve.services.gateway.calls import Delta
from pdserve.services.gateway.cost import Report
from pdserve.services.gateway.gateway import Gateway
from pdserve.services.gateway.prompt import ChatMessage, Prompt
from pdserve.services.gateway.registry import LayoutMismatchError, WorkerRegistry

from pdserve import telemetry, tls
from pdserve.rpc import StatusError
from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.v1.convert import logprobs_to_proto, sampling_from_proto


def prompt_from_proto(request: generation_pb2.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return Prompt(text=request.text)
    if kind == "token_ids":
        return Prompt(token_ids=tuple(request.token_ids.ids))
    if kind == "chat":
        return Prompt(chat=tuple(ChatMessage(m.role, m.content) for m in request.chat.messages))
    return Prompt()


def response_from_delta(request_id: str, d: Delta) -> generation_pb2.GenerateResponse:
    resp = generation_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=d.token_ids,
        text=d.text,
        logprobs=[logprobs_to_proto(lp) for lp in d.logprobs],
        finish_reason=d.finish_reason,
    )
    if d.usage is not None:
        resp.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=d.usage.prompt_tokens,
                completion_tokens=d.usage.completion_tokens,
                cached_prompt_tokens=d.usage.cached_prompt_tokens,
            )
        )
    return resp


def authorization(metadata) -> str | None:
    """The ``authorization`` metadata value of a call (gRPC lower-cases metadata keys)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Each call is one ``GatewayRequest`` (span, logs, metrics), closed with the status the
    client gets. ``Complete`` is ``Generate``'s stream, collected."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _generate(
        self, request: generation_pb2.GenerateRequest, context, stream: bool
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        gw = self.gateway
        metadata = context.invocation_metadata()
        with gw.open(request.request_id, metadata, stream) as req:
            caller = gw.authenticate(authorization(metadata))
            gw.check_model(request.model)
            gw.check_request_id(request.request_id)
            gw.check_affinity_key(request.affinity_key)
            params = sampling_from_proto(request.sampling)
            deltas = gw.generate(
                req,
                prompt_from_proto(request),
                params,
                context.time_remaining(),
                caller,
                request.affinity_key,
            )
            async with contextlib.aclosing(deltas):
                async for d in deltas:
                    resp = response_from_delta(req.request_id, d)
                    # grpc.aio starts sending a yielded message before it asks for the next;
                    # the client has it long before that (bench/grpc_send_timing.py)
                    req.forwarded(d.received_at)
                    yield resp

    async def Generate(self, request, context):
        async with contextlib.aclosing(self._generate(request, context, stream=True)) as stream:
            async for resp in stream:
                yield resp

    async def Complete(self, request, context):
        done = generation_pb2.CompleteResponse()
        async with contextlib.aclosing(self._generate(request, context, stream=False)) as stream:
            async for resp in stream:
                done.request_id = resp.request_id
                done.token_ids.extend(resp.token_ids)
                done.text += resp.text
                done.logprobs.extend(resp.logprobs)
                done.finish_reason = resp.finish_reason
                if resp.HasField("usage"):
                    done.usage.CopyFrom(resp.usage)
        return done

    async def ListModels(self, request, context):
        gw = self.gateway
        gw.authenticate(authorization(context.invocation_metadata()))
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelInfo(id=gw.model_name, max_model_len=gw.max_model_len)]
        )


class RegistryServicer(worker_pb2_grpc.RegistryServicer):
    """With ``cluster_token``, each call must carry it (metadata ``tls.TOKEN_METADATA_KEY``) or
    ends UNAUTHENTICATED; without, the server it is on must require client certificates (the
    gateway does not start otherwise: see ``GatewayOptions``)."""

    def __init__(self, registry: WorkerRegistry, cluster_token: str | None = None) -> None:
        self.registry = registry
        self.cluster_token = cluster_token

    def _authenticate(self, context) -> None:
        if self.cluster_token is None:
            return
        given = dict(context.invocation_metadata()).get(tls.TOKEN_METADATA_KEY)
        if not tls.token_matches(given, self.cluster_token):
            reason = "wrong cluster token" if given else "no cluster token"
            telemetry.logger().warning("worker.unauthenticated", peer=context.peer(), error=reason)
            raise StatusError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{reason}: start the worker with this cluster's token "
                "(--cluster-token or PDSERVE_CLUSTER_TOKEN)",
            )

    async def Register(self, request: worker_pb2.RegisterRequest, context):
        self._authenticate(context)
        try:
            self.registry.register(
                request.worker_id, request.role, request.address, request.layout.compat_hash
            )
        except LayoutMismatchError as e:
            telemetry.logger().warning(
                "worker.refused", worker_id=request.worker_id, address=request.address, error=str(e)
            )
            raise
        telemetry.logger().info(
            "worker.registered",
            worker_id=request.worker_id,
            role=request.role,
            address=request.address,
        )
        return worker_pb2.RegisterResponse(lease_ms=int(self.registry.lease_s * 1000))

    async def Heartbeat(self, request: worker_pb2.HeartbeatRequest, context):
        self._authenticate(context)
        report = (
            Report.from_proto(request.stats, time.monotonic())
            if request.HasField("stats")
            else None
        )
        return worker_pb2.HeartbeatResponse(
            known=self.registry.heartbeat(request.worker_id, report)
        )

    async def Deregister(self, request: worker_pb2.DeregisterRequest, context):
        self._authenticate(context)
        known = self.registry.deregister(request.worker_id)
        telemetry.logger().info(
            "worker.deregistered", worker_id=request.worker_id, reason=request.reason, known=known
        )
        return worker_pb2.DeregisterResponse(known=known)
