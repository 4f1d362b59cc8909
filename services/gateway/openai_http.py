"""The OpenAI-compatible HTTP API of the gateway: /v1/completions, /v1/chat/completions, /v1/models.

Starlette routes served by uvicorn inside the gateway's event loop (``OpenAIServer``), on a port of
their own. Every request runs the gRPC API's path: ``Gateway.open`` (span, logs, metrics), then
``Gateway.generate(req, prompt, params)`` — the HTTP side only converts (``openai_api``). Errors
carry the status the gRPC API would end the call with, mapped to HTTP (``HTTP_STATUS``), in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. A client that disconnects
cancels its request: the gateway's generator is closed, which cancels the worker calls and frees
their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import uvicorn
from pdserve.services.errors import STATUS_CODES
from pdserve.services.gateway import openai_api as api
from pdserve.services.gateway.auth import ApiKey
from pdserve.services.gateway.calls import Delta
from pdserve.services.gateway.gateway import Gateway
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.rpc import status_of
from pdserve.tls import TLSConfig

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
RETRY_AFTER_S = 1  # told to a client refused with 429 when no better figure is known (decode full)


def _error(
    code: grpc.StatusCode,
    message: str,
    param: str | None = None,
    retry_after_s: float = RETRY_AFTER_S,
) -> JSONResponse:
    status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if status == 429 else None
    return JSONResponse(
        api.error_body(message, type_, param, code.name.lower()), status, headers=headers
    )


def error_response(exc: BaseException) -> JSONResponse:
    """The response to a request that raised ``exc``: the gRPC status it maps to, as HTTP."""
    code, message = status_of(exc, STATUS_CODES)
    retry_after_s = getattr(exc, "retry_after_s", RETRY_AFTER_S)  # a key over its limits says
    return _error(code, message, getattr(exc, "param", None), retry_after_s)


class _ClientGone(Exception):
    pass


def json_content_type(value: str | None) -> bool:
    """A body the API reads: declared JSON, or not declared. Anything else (a form, text/plain)
    is what a web page can make a browser send to another site without asking first: refusing it
    keeps pages from using a visitor's network position against a gateway without keys."""
    return value is None or value.split(";")[0].strip().lower() == "application/json"


async def _read_json(request: Request) -> Any:
    if not json_content_type(request.headers.get("content-type")):
        raise _UnsupportedMediaType()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > api.MAX_BODY_BYTES:
        raise _TooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > api.MAX_BODY_BYTES:
            raise _TooLarge()
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise api.RequestError(f"the request body is not valid JSON: {e}"[:300]) from None
    # JSON's \u escapes may spell half a surrogate pair, which no UTF-8 text holds: the tokenizer
    # and the gRPC messages to the workers would fail on it
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end]
        raise api.RequestError(
            f"the request body has a string that is not valid Unicode ({bad!r}, half a surrogate "
            "pair); every string must be UTF-8 text"
        ) from None
    except RecursionError:
        raise api.RequestError("the request body is nested too deeply") from None
    return body


class _UnsupportedMediaType(Exception):
    pass


class _TooLarge(Exception):
    pass


async def _unless_disconnected(request: Request, aw):
    """``await aw``, unless the client disconnects first: then it is cancelled (_ClientGone).
    Awaited in this task, not a task of its own: the answer goes on from here without another
    pass of the event loop (behind every other ready callback) when ``aw`` is done."""
    me = asyncio.current_task()
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        me.cancel()

    watcher = asyncio.ensure_future(disconnected())
    try:
        return await aw
    except asyncio.CancelledError:
        if not gone:
            raise
        me.uncancel()
        raise _ClientGone() from None
    finally:
        watcher.cancel()


class OpenAIApp:
    """The routes. Every request's ``Authorization: Bearer <key>`` goes to the gateway's
    ``authenticate`` first (401 without a valid key when the gateway has keys), as gRPC's
    ``authorization`` metadata does."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},
        )

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            api.error_body(f"{request.method} {request.url.path}: {exc.detail}", type_, None, None),
            exc.status_code,
            headers=exc.headers,
        )

    async def models(self, request: Request) -> Response:
        gw = self.gateway
        try:
            gw.authenticate(request.headers.get("authorization"))
        except Exception as e:
            return error_response(e)
        return JSONResponse(api.model_list(gw.model_name, gw.max_model_len))

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        gw = self.gateway
        try:
            caller = gw.authenticate(request.headers.get("authorization"))
            body = await _read_json(request)
            if chat:
                r = api.parse_chat(body, default_max_tokens=1)
                if not r.max_tokens_given:  # the rest of the context, as OpenAI does
                    ids, _ = await gw.encode(r.prompt)
                    rest = max(gw.max_model_len - len(ids), 1)
                    r = dataclasses.replace(
                        r, params=dataclasses.replace(r.params, max_tokens=rest)
                    )
            else:
                r = api.parse_completion(body)
            gw.check_model(r.model)
        except _UnsupportedMediaType:
            return JSONResponse(
                api.error_body(
                    "the request body must be JSON, with Content-Type: application/json",
                    "invalid_request_error",
                    None,
                    "unsupported_media_type",
                ),
                415,
            )
        except _TooLarge:
            return JSONResponse(
                api.error_body(
                    f"the request body exceeds {api.MAX_BODY_BYTES} bytes",
                    "invalid_request_error",
                    None,
                    "request_too_large",
                ),
                413,
            )
        except Exception as e:
            return error_response(e)
        request_id = request.headers.get("x-request-id", "")
        events = self._deltas(request, r, request_id, caller)
        try:
            # the first delta (or the error) decides the status; the client may leave meanwhile
            first = await _unless_disconnected(request, anext(events))
        except _ClientGone:
            await events.aclose()  # ended already, unless it had just yielded its first delta
            return Response(status_code=499)
        except Exception as e:
            return error_response(e)
        req_id, first_delta = first
        tok = gw.tokenizer
        prefix, obj = ("chatcmpl-", "chat.completion") if chat else ("cmpl-", "text_completion")
        head = {"id": prefix + req_id, "created": api.now(), "model": gw.model_name}
        if not r.stream:
            try:
                deltas = await _unless_disconnected(request, _collect(first_delta, events))
            except _ClientGone:
                return Response(status_code=499)
            except Exception as e:
                return error_response(e)
            return JSONResponse(_whole(head, obj, chat, deltas, r, tok))
        return _EventStream(_sse(head, obj, chat, first_delta, events, r, tok), events)

    async def _deltas(
        self, request: Request, r: api.Request, request_id: str, caller: ApiKey | None
    ) -> AsyncIterator[tuple[str, Delta]]:
        """(request id, delta) until the last delta; ``with`` the gateway's request accounting,
        which ends with the status the client gets (CANCELLED when it went away)."""
        gw = self.gateway
        with gw.open(request_id, list(request.headers.items()), r.stream) as req:
            gw.check_request_id(request_id, "the X-Request-Id header")
            gw.check_affinity_key(r.affinity_key, "user")
            deltas = gw.generate(req, r.prompt, r.params, None, caller, r.affinity_key)
            async with contextlib.aclosing(deltas):
                async for d in deltas:
                    try:
                        yield req.request_id, d
                    finally:  # its events are sent (the last: this generator is closed)
                        req.forwarded(d.received_at)


async def _collect(first: Delta, events) -> list[Delta]:
    out = [first]
    async with contextlib.aclosing(events):
        async for _, d in events:
            out.append(d)
    return out


def _lps(d: Delta) -> list:
    return d.logprobs[: len(d.token_ids)]


def _whole(head: dict, obj: str, chat: bool, deltas: list[Delta], r: api.Request, tok) -> dict:
    text = "".join(d.text for d in deltas)
    lps = [lp for d in deltas for lp in _lps(d)]
    logprobs = None
    if r.params.logprobs is not None:
        logprobs = api.chat_logprobs(tok, lps) if chat else api.completion_logprobs(tok, lps, 0)
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["finish_reason"] = deltas[-1].finish_reason
    return {**head, "object": obj, "choices": [choice], "usage": api.usage(deltas[-1])}


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(
    head: dict, obj: str, chat: bool, first: Delta, events, r: api.Request, tok
) -> AsyncIterator[bytes]:
    """The stream's events, ``data: [DONE]`` last. An error after the first delta (a worker failed
    mid-stream) is sent as an event with OpenAI's error object, then [DONE]."""
    head = {**head, "object": obj + ".chunk" if chat else obj}
    usage_field = {"usage": None} if r.include_usage else {}
    offset = 0

    def chunk(choice: dict) -> bytes:
        return _event({**head, "choices": [{"index": 0, **choice}], **usage_field})

    try:
        if chat:
            yield chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})  # fmt: skip
        d: Delta | None = first
        last = first
        while d is not None:
            last = d
            lp = None
            if r.params.logprobs is not None:
                lp = (
                    api.chat_logprobs(tok, _lps(d))
                    if chat
                    else api.completion_logprobs(tok, _lps(d), offset)
                )
            offset += len(d.text)
            if chat:
                if d.token_ids or d.text:
                    yield chunk(
                        {"delta": {"content": d.text}, "logprobs": lp, "finish_reason": None}
                    )
                if d.finish_reason:
                    yield chunk({"delta": {}, "logprobs": None, "finish_reason": d.finish_reason})
            else:
                yield chunk(
                    {"text": d.text, "logprobs": lp, "finish_reason": d.finish_reason or None}
                )
            if d.finish_reason:
                # let the request end as it did (not closed from outside: "cancelled")
                await anext(events, None)
                break
            nxt = await anext(events, None)
            d = None if nxt is None else nxt[1]
        if r.include_usage and last.usage is not None:
            yield _event({**head, "choices": [], "usage": api.usage(last)})
    except Exception as e:
        code, message = status_of(e, STATUS_CODES)
        status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
        yield _event(api.error_body(message, type_, None, code.name.lower()))
    finally:
        await events.aclose()
    yield b"data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events; however the response ends (the client went away before the stream
    began, say), the request's generator is closed: its worker calls are cancelled."""

    def __init__(self, body: AsyncIterator[bytes], events) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


class _Server(uvicorn.Server):
    def capture_signals(self):
        # The gateway process handles SIGINT/SIGTERM itself (main.py), and stops this server.
        return contextlib.nullcontext()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0 picks a port).

    Made with proto IPPROTO_TCP, not the 0 of ``socket.create_server``: asyncio disables Nagle's
    algorithm (TCP_NODELAY) only on connections whose socket says IPPROTO_TCP, and with Nagle on
    a response's body waits on the client's delayed ACK of its head, some 40 ms an answer (and a
    streamed token)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server does
        sock.bind((host, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


class OpenAIServer:
    """The HTTP API serving in the running event loop: ``await start()``, ``await stop()``;
    HTTPS with ``tls`` (its certificate and key; clients need no certificate)."""

    def __init__(
        self, gateway: Gateway, host: str, port: int, tls: TLSConfig | None = None
    ) -> None:
        self.app = OpenAIApp(gateway)
        self.host = host
        self.tls = tls
        self.requested_port = port
        self.port = 0
        self._server: _Server | None = None
        self._sock: socket.socket | None = None
        self._main: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind (OSError when the port is taken) and serve."""
        self._sock = sock = _listen(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app.app,
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
            ssl_certfile=self.tls.cert if self.tls else None,
            ssl_keyfile=self.tls.key if self.tls else None,
        )
        config.load()
        server = self._server = _Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._main = asyncio.create_task(server.main_loop())

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting; requests in flight get ``grace`` seconds, then are cancelled."""
        server = self._server
        if server is None:
            if self._sock is not None:
                self._sock.close()
            return
        self._server = None
        # (0 would time out at once, and log so, even with nothing in flight)
        server.config.timeout_graceful_shutdown = max(grace, 0.01)  # type: ignore[assignment]
        server.should_exit = True
        if self._main is not None:
            await self._main
        await server.shutdown(sockets=[self._sock] if self._sock else None)
