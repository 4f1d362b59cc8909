"""Gateway: tokenize, validate, route to a decode + prefill pair, stream tokens back.

    client ──Generate──> Gateway ──Decode.Generate──> D   (1) admitted: blocks reserved
                                 ──Prefill.Prefill──> P   (2) KV pushed P -> D, first token back
                         first token ──> client            (TTFT does not wait for the transfer)
                         tokens 2..N <── D stream ──> client

Failures before the first token are retried on another pair; after it, the client gets
UNAVAILABLE at once. A full decode worker answers RESOURCE_EXHAUSTED at once: when every one is
full, the request queues here until capacity frees (or its deadline / the queue timeout passes).
When no prefill worker is alive, a colocated worker (or a decode worker prefilling locally)
serves, and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from pdserve.services.gateway import cost as costs
from pdserve.services.gateway import placement
from pdserve.services.gateway.accounting import GatewayRequest
from pdserve.services.gateway.auth import ApiKey, KeyStore, Limiter, Unauthenticated
from pdserve.services.gateway.calls import Delta, Usage, WorkerFailed, call_failed, chunk, read
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.cost import Job
from pdserve.services.gateway.prompt import Prompt, encode_async, max_prompt_chars
from pdserve.services.gateway.registry import Worker, WorkerRegistry
from pdserve.services.gateway.router import Router
from pdserve.services.gateway.warm import ReplyWarmer

from pdserve import telemetry
from pdserve.metrics import GatewayMetrics
from pdserve.rpc import Gate, StatusError
from pdserve.sampling_params import SamplingParams
from pdserve.text import TextStream
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import worker_pb2
from pdserve.v1.convert import logprobs_from_proto, sampling_to_proto
from pdserve.validation import validate_prompt, validate_request_id

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
}


class GatewayError(StatusError):
    """Ends a request with a status code and a message for the client."""


class Gateway:
    """Serves ``model_name`` (its tokenizer, context length and vocabulary size) through the
    workers in ``self.registry``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        model_name: str,
        config: GatewayConfig | None = None,
        keys: KeyStore | None = None,
        registry: WorkerRegistry | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.config = config or GatewayConfig()
        self.registry = registry or WorkerRegistry(self.config.lease_s)
        self.router = Router(
            self.config.policy,
            stale_s=2 * self.config.lease_s / 3,  # two heartbeats missed
            affinity_slack_s=self.config.affinity_slack_s,
        )
        self._capacity = asyncio.Condition()
        self.metrics = GatewayMetrics()
        self.keys = keys or KeyStore({})  # none: open to every caller
        self.limiter = Limiter(self.metrics)
        self.warmer = ReplyWarmer(self.metrics) if self.config.warm_replies else None
        self._ids = itertools.count()
        self._instance = secrets.token_hex(3)  # this gateway's, in the ids it makes
        self._max_chars = max_prompt_chars(tokenizer, max_model_len)
        # closed while the gateway drains: new requests get UNAVAILABLE, running ones finish
        self.gate = Gate("the gateway is draining (shutting down)")

    async def encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """The prompt's token ids and text (``prompt.encode``): a text too long for the context in
        any tokenization is refused before it is tokenized, a long one is tokenized off the loop."""
        return await encode_async(prompt, self.tokenizer, self._max_chars)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key from an ``authorization`` header value (``Bearer <key>``), None when
        the gateway has no keys (open); Unauthenticated (UNAUTHENTICATED) otherwise. Both APIs
        call it first, then pass the key to ``generate``."""
        try:
            return self.keys.authenticate(authorization)
        except Unauthenticated as e:
            self.metrics.auth_failures.labels(e.reason).inc()
            raise

    def open(self, request_id: str, metadata, stream: bool) -> GatewayRequest:
        """Start accounting for a request (its span continues a traceparent in ``metadata``);
        ``with`` it, it ends with the status the client gets. The request goes by
        ``request_id``, or by an id made here when that is empty or one ``check_request_id``
        refuses (logs and spans do not carry what a client may not send)."""
        try:
            validate_request_id(request_id)
        except ValueError:
            request_id = ""
        n = next(self._ids)
        req = GatewayRequest(
            request_id or f"gw-{self._instance}-{n}",
            telemetry.from_metadata(metadata),
            self.metrics,
            self.model_name,
            self.router.policy,
            stream,
        )
        # Ids on the workers must be unique: a client's id may repeat, and other gateways send
        # to the same workers. Tries append ".<attempt>".
        req.worker_request_id = (
            req.request_id if not request_id else f"{request_id}@{self._instance}-{n}"
        )
        return req

    def check_model(self, model: str) -> None:
        """NOT_FOUND unless ``model`` is empty (the served one) or the one served here."""
        if model and model != self.model_name:
            raise GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model {model!r:.80} is not served here; available: {self.model_name!r}",
            )

    def check_request_id(self, request_id: str, name: str = "request_id") -> None:
        """ValueError (INVALID_ARGUMENT) unless ``request_id`` is one a client may send (``name``:
        what its API calls it): both APIs call it ``with`` the request ``open`` gave them."""
        validate_request_id(request_id, name)

    def check_affinity_key(self, key: str, name: str = "affinity_key") -> None:
        """ValueError (INVALID_ARGUMENT) unless ``key`` is an affinity key a client may send: the
        limits of a request id (``name``: what its API calls it)."""
        validate_request_id(key, name)

    async def generate(
        self,
        req: GatewayRequest,
        prompt: Prompt,
        params: SamplingParams,
        timeout: float | None = None,
        caller: ApiKey | None = None,
        affinity_key: str = "",
    ) -> AsyncIterator[Delta]:
        """Deltas of ``req`` until one carries a finish reason (and the usage). ``caller``: what
        ``authenticate`` returned (None is refused when keys are configured); ``affinity_key``:
        requests with the same key go to the same prefill worker (``check_affinity_key`` first).
        ValueError for a prompt that cannot be served (INVALID_ARGUMENT), GatewayError when no worker serves it,
        RateLimited / RequestTooLarge when the caller's limits refuse it, UNAVAILABLE while the
        gateway drains."""
        if caller is None:
            self.authenticate(None)  # refuses unless the gateway is open
        with self.gate.enter():
            ids, prompt_text = await self.encode(prompt)
            req.prepared(ids, params.max_tokens, prompt_text)
            req.affinity_key = affinity_key
            validate_prompt(ids, params.max_tokens, self.max_model_len, self.vocab_size)
            text = TextStream(self.tokenizer, ids, params.stop)
            # prompt + max_tokens reserved from the key's budget; what is not used is refunded
            # when the request ends, however it ends (finish, stop string, error, cancel)
            grant = None
            if caller is not None:
                req.log = req.log.bind(key=caller.key_id)
                req.span.set_attribute("api_key", caller.key_id)
                grant = self.limiter.admit(caller, len(ids), params.max_tokens)
            num_tokens = 0
            try:
                async for delta in self._route(req, ids, params, text, timeout):
                    num_tokens += len(delta.token_ids)
                    req.tokens(len(delta.token_ids), delta.text, delta.finish_reason)
                    if delta.finish_reason:
                        delta.usage = Usage(len(ids), num_tokens, req.num_cached_prompt_tokens)
                    yield delta
                    if delta.finish_reason:
                        return
            finally:
                if grant is not None:
                    grant.release(len(ids) + num_tokens)

    async def _route(
        self, req: GatewayRequest, ids, params, text: TextStream, timeout
    ) -> AsyncIterator[Delta]:
        cfg = self.config
        # failed for this request: not asked again unless it comes back (restarted, rejoined)
        tried: dict[str, int] = {}  # worker id -> its incarnation then
        full: set[str] = set()  # refused admission (RESOURCE_EXHAUSTED): asked again once it frees
        outage_since = None  # loop.time() since when no worker is left to try
        loop = asyncio.get_running_loop()
        # Queue at most queue_timeout_s, and never past the request's own deadline.
        queue_s = cfg.queue_timeout_s if timeout is None else min(timeout, cfg.queue_timeout_s)
        give_up_at = loop.time() + queue_s
        last_error = "no worker is registered"
        attempts = 0
        tries = itertools.count()
        sent: list[int] = []  # tokens streamed to the client: a resumed try continues after them
        resumes = 0
        while attempts < cfg.max_attempts:
            # A resumed try prefills prompt + the tokens sent so far and generates the rest; the
            # sampler's draws depend on the position only (pdserve/sequence.py), so seeded
            # sampling goes on as if nothing happened.
            try_ids = ids + sent if sent else ids
            try_params = (
                replace(params, max_tokens=params.max_tokens - len(sent)) if sent else params
            )
            job = Job(try_ids, try_params.max_tokens, req.affinity_key)
            exclude = self.registry.still_failed(tried) | full
            stream = self._pick(req, next(tries), job, try_params, timeout, exclude)
            if stream is None:
                if not full:
                    # No worker left to try: wait for one to come back (restarted, rejoined)
                    # through an outage of at most outage_wait_s, within the queue bound.
                    now = loop.time()
                    if outage_since is None:
                        outage_since = now
                        req.log.warning("request.waiting_for_worker", error=last_error)
                    if not self._in_outage(now - outage_since) or now >= give_up_at:
                        break
                # Every decode worker is full: queue here until one of our requests ends (or a poll
                # interval passes: other gateways' requests free blocks too).
                elif loop.time() >= give_up_at:
                    raise GatewayError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"every decode worker stayed full for {queue_s:g} s",
                    )
                self.metrics.waiting.inc()
                try:
                    async with self._capacity:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(
                                self._capacity.wait(), min(0.25, give_up_at - loop.time())
                            )
                finally:
                    self.metrics.waiting.dec()
                full.clear()
                continue
            outage_since = None
            sent_before = len(sent)
            try:
                async for token_ids, logprobs, finish, num_cached in stream:
                    if not sent:  # a resumed try's prompt is longer: its count is not ours
                        req.num_cached_prompt_tokens = num_cached
                    delta = Delta(logprobs=logprobs, received_at=time.perf_counter())
                    for t in token_ids:
                        delta.token_ids.append(t)
                        if text.add(t):
                            finish = "stop"
                            break
                    delta.text = text.take(finished=bool(finish))
                    delta.finish_reason = finish
                    if not delta.token_ids and not delta.text and not finish:
                        continue
                    sent += delta.token_ids
                    yield delta
                    if finish:
                        return
                raise WorkerFailed(None, "worker stream ended without a finish reason")
            except WorkerFailed as e:
                if len(sent) > sent_before:  # this try streamed, then failed: go on elsewhere
                    if e.worker is not None:
                        tried[e.worker.worker_id] = e.worker.incarnation
                        e.worker.failures += 1
                    if resumes >= cfg.max_resumes:
                        raise GatewayError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"worker failed mid-stream after {len(sent)} tokens "
                            f"({resumes} resumes, at most {cfg.max_resumes}): {e}",
                        ) from None
                    resumes += 1
                    last_error = f"resuming after {len(sent)} tokens: {e}"
                    self.metrics.resumes.inc()
                    req.log.warning("request.resume", error=str(e), sent_tokens=len(sent))
                    req.span.add_event("resume", {"error": str(e), "sent_tokens": len(sent)})
                    continue
                # Failed before streaming (a resumed try too: it is admitted like a new request)
                last_error = f"resuming after {len(sent)} tokens: {e}" if sent else str(e)
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.worker is not None:
                    full.add(e.worker.worker_id)
                    continue
                if e.code is not None and e.code not in RETRYABLE:
                    raise GatewayError(e.code, str(e)) from None
                if e.worker is not None:
                    tried[e.worker.worker_id] = e.worker.incarnation
                    e.worker.failures += 1
                attempts += 1
                self.metrics.retries.inc()
                req.log.warning("request.retry", error=last_error)
            finally:
                await stream.aclose()
        raise GatewayError(
            grpc.StatusCode.UNAVAILABLE, f"no worker could serve the request: {last_error}"
        )

    def _in_outage(self, waited: float) -> bool:
        """Whether a request that has found no worker to try for ``waited`` seconds waits on: for
        at most outage_wait_s, and only when the cluster could serve that recently (a gateway
        that never had a worker, or lost them all long ago, fails fast)."""
        limit = self.config.outage_wait_s
        self.registry.can_serve()  # notes the time if a path is there now
        seen = self.registry.path_seen
        return waited < limit and seen is not None and time.monotonic() - seen < limit

    def _pick(self, req: GatewayRequest, attempt: int, job: Job, params, timeout, exclude):
        """The token stream of the next pair to try, or None when no worker is left."""
        # Each try has its own id on the workers: a cancelled try may still be winding down there.
        rid = f"{req.worker_request_id}.{attempt}"
        md = telemetry.to_metadata(req.ctx)
        pick = self.router.pick
        prefill = pick(self.registry.alive("prefill"), exclude, job)
        decode = pick(self.registry.alive("decode"), exclude, job, decode=True) if prefill else None
        if decode is None:
            # No pair: a colocated worker, or (no prefill worker at all) a decode worker prefills
            # locally. registry.can_serve() is this rule, for the gateway's health.
            pool = self.registry.alive("colocated")
            if prefill is None:
                pool += self.registry.alive("decode")
            local = pick(pool, exclude, job)
            if local is None:
                return None
            req.routed(f"local:{local.role}", local.address, "", attempt)
            return self._local(local, rid, job, params, timeout, md)
        reason = placement.place(job, prefill, decode, self.config, self.router.stale_s)
        self.metrics.placement.labels(reason).inc()
        why = placement.weighed(prefill, decode)
        if reason != placement.DISAGGREGATED:
            req.routed("local:decode", decode.address, "", attempt, reason, why)
            return self._local(decode, rid, job, params, timeout, md)
        req.routed("disaggregated", decode.address, prefill.address, attempt, reason, why)
        return self._disaggregated(decode, prefill, rid, job, params, timeout, md)

    async def _released(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    async def _local(self, worker: Worker, rid, job: Job, params, timeout, md):
        ids = job.prompt_ids
        req = worker_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=sampling_to_proto(params),
            prefill_locally=True,
        )
        cost = len(ids) + params.max_tokens
        todo = costs.tokens_to_compute(worker, job, costs.now(), self.router.stale_s)
        worker.outstanding_tokens += cost
        worker.local_prefill_tokens += todo  # until its first token
        worker.prompts += 1
        blocks = costs.request_blocks(worker, cost)
        sent_at = worker.sent(todo, blocks)
        prefilling, generated = True, []
        call = worker.stub.Generate(req, timeout=timeout, metadata=md)
        worker.track(call)
        costs.prompt_sent(worker, job)
        try:
            async for msg in read(call, worker, generated):
                if prefilling:
                    worker.local_prefill_tokens -= todo
                    worker.prompts -= 1
                    worker.streams += 1
                    prefilling = False
                yield chunk(msg.tokens, msg.tokens.cached_prompt_tokens)
        finally:
            worker.outstanding_tokens -= cost
            worker.done(sent_at, todo, blocks)
            if prefilling:
                worker.local_prefill_tokens -= todo
                worker.prompts -= 1
            else:
                worker.streams -= 1
            costs.prompt_ended(worker, job, not prefilling, generated)
            worker.calls.discard(call)
            call.cancel()
            await self._released()

    async def _disaggregated(
        self, decode: Worker, prefill: Worker, rid, job: Job, params, timeout, md
    ):
        ids = job.prompt_ids
        sampling = sampling_to_proto(params)
        cost = len(ids) + params.max_tokens
        # prefill work is counted in the prompt tokens to compute there (its cached prefix off)
        now, stale_s = costs.now(), self.router.stale_s
        prefill_todo, believed = costs.work_and_belief(prefill, job, now, stale_s)
        hold_s = costs.kv_hold_s(prefill, job, now, stale_s, self.config.kv_timeout_s)
        decode.outstanding_tokens += cost
        prefill.outstanding_tokens += prefill_todo
        prefill.prompts += 1
        blocks = costs.request_blocks(decode, cost)
        decode_sent_at = decode.sent(0, blocks)
        prefill_sent_at = prefill.sent(prefill_todo)
        call = decode.stub.Generate(
            worker_pb2.DecodeRequest(
                request_id=rid,
                prompt_token_ids=ids,
                sampling=sampling,
                kv_timeout_ms=int(hold_s * 1000),
            ),
            timeout=timeout,
            metadata=md,
        )
        decode.track(call)
        # its prefill call leaves after those routed there before it (no await since hold_s)
        ticket = prefill.send_order.enter()
        prefill_done = prefilled = admitted = streaming = ended = False
        generated: list[int] = []  # the first token, then the decode worker's
        try:
            reader = read(call, decode, generated)
            first = await anext(reader, None)
            if first is None or not first.HasField("admitted"):
                raise WorkerFailed(decode, "decode worker did not admit the request")
            costs.prompt_sent(decode, job)  # it keeps the prompt's blocks (decode-side reuse)
            admitted = True
            await prefill.send_order.turn(ticket)
            prefill_call = prefill.stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=ids,
                    sampling=sampling,
                    destination=first.admitted.destination,
                    decode_idle=placement.decode_idle(decode, cost),
                ),
                timeout=timeout or hold_s,
                metadata=md,
            )
            prefill.send_order.leave(ticket)
            prefill.track(prefill_call)
            costs.prompt_sent(prefill, job)
            placement.prefill_started(prefill, time.perf_counter())
            computed = None
            try:
                resp = await prefill_call
                prefilled = True
                prefill.progressed()
                computed = len(ids) - resp.cached_prompt_tokens
                costs.record_hits(prefill, believed, resp.cached_prompt_tokens)
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                raise call_failed(prefill, e) from None
            finally:
                placement.record_prefill(prefill, computed, time.perf_counter())
                prefill.calls.discard(prefill_call)
                prefill.outstanding_tokens -= prefill_todo
                prefill.prompts -= 1
                prefill.done(prefill_sent_at, prefill_todo)
                costs.prompt_ended(prefill, job, prefilled)
                prefill_done = True
            lp = [logprobs_from_proto(resp.first_token)] if params.logprobs is not None else []
            decode.streams += 1
            streaming = True
            generated.append(resp.first_token.token_id)
            yield [resp.first_token.token_id], lp, "", resp.cached_prompt_tokens
            async for msg in reader:
                ended = bool(msg.tokens.finish_reason)  # the caller stops reading after it
                yield chunk(msg.tokens, resp.cached_prompt_tokens)
        finally:
            prefill.send_order.leave(ticket)
            if ended and self.warmer is not None:
                self.warmer.reply_ended(prefill, job, generated, rid, md)
            decode.outstanding_tokens -= cost
            decode.done(decode_sent_at, 0, blocks)
            if streaming:
                decode.streams -= 1
            if admitted:
                costs.prompt_ended(decode, job, prefilled, generated)
            decode.calls.discard(call)
            if not prefill_done:
                prefill.outstanding_tokens -= prefill_todo
                prefill.prompts -= 1
                prefill.done(prefill_sent_at, prefill_todo)
            call.cancel()
            await self._released()
