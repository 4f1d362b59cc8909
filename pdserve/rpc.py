"""grpc.aio server and channel factories: health, reflection, limits and the error interceptor
installed in one place.

Servicers do not call ``context.abort``: they raise. A ``StatusError`` ends the call with its own
code and message; any other exception with the code its class has in the server's error table
(the nearest class in its MRO that the table names), and the exception's text as the message; an
exception the table does not know ends it with INTERNAL, its traceback logged. A request whose
bytes do not decode as the method's message ends with INVALID_ARGUMENT (grpc's own answer is
UNKNOWN, which callers would retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Iterable, Iterator, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve import telemetry

# Requests larger than this are refused by gRPC itself with RESOURCE_EXHAUSTED (a 10 MB prompt
# is never legitimate: the longest context is far smaller).
MAX_MESSAGE_BYTES = 4 << 20

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

# A status message longer than this is cut (it travels in a header; a client refuses large ones).
MAX_STATUS_MESSAGE_CHARS = 512

ErrorTable = Mapping[type[Exception], grpc.StatusCode]


class StatusError(Exception):
    """Ends an RPC with ``code`` and ``message``, exactly as given, and ``trailing_metadata``
    (none here; a subclass may send some, e.g. ``retry-after``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def _table_code(exc: BaseException, errors: ErrorTable) -> grpc.StatusCode | None:
    for cls in type(exc).__mro__:
        code = errors.get(cls)
        if code is not None:
            return code
    return None


def _cut(message: str) -> str:
    if len(message) <= MAX_STATUS_MESSAGE_CHARS:
        return message
    return message[: MAX_STATUS_MESSAGE_CHARS - 3] + "..."


def status_of(exc: BaseException, errors: ErrorTable) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised ``exc`` ends with (see the module's docstring), its message
    at most MAX_STATUS_MESSAGE_CHARS long."""
    if isinstance(exc, StatusError):
        return exc.code, _cut(str(exc))
    code = _table_code(exc, errors)
    if code is None:
        return grpc.StatusCode.INTERNAL, _cut(f"internal error: {type(exc).__name__}: {exc}")
    return code, _cut(str(exc))


class _Undecodable:
    """What a request's bytes became when they do not decode: the handler is not called."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def abort(self, context) -> None:
        message = _cut(f"the request does not decode: {self.error}")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _lenient(deserialize):
    """``deserialize``, returning an _Undecodable where it raises."""
    if deserialize is None:
        return None

    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as e:  # protobuf's DecodeError, or whatever a deserializer raises
            return _Undecodable(e)

    return parse


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns what a unary-unary or unary-stream handler raises into ``context.abort(code,
    message)`` (a streaming handler may raise after it has yielded: the client gets the messages,
    then the status), and a request that does not decode into INVALID_ARGUMENT. Cancellation and
    the handler's own aborts pass through."""

    def __init__(self, errors: ErrorTable) -> None:
        self.errors = errors

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        if handler.response_streaming:
            behaviour = handler.unary_stream
            if inspect.isasyncgenfunction(behaviour):
                wrap, factory = self._stream, grpc.unary_stream_rpc_method_handler
            elif inspect.iscoroutinefunction(behaviour):  # writes with context.write
                wrap, factory = self._unary, grpc.unary_stream_rpc_method_handler
            else:
                return handler
        else:
            behaviour = handler.unary_unary
            if not inspect.iscoroutinefunction(behaviour):
                return handler
            wrap, factory = self._unary, grpc.unary_unary_rpc_method_handler
        return factory(
            wrap(behaviour, method),
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def _unary(self, behaviour, method: str):
        async def call(request, context):
            if isinstance(request, _Undecodable):
                return await request.abort(context)
            try:
                return await behaviour(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # every exception ends the call with a status
                await self._abort(context, e, method)

        return call

    def _stream(self, behaviour, method: str):
        async def call(request, context):
            if isinstance(request, _Undecodable):
                await request.abort(context)
            try:
                # aclosing: closing this generator closes the handler's at once (its finally
                # blocks run then, not whenever it is collected)
                async with contextlib.aclosing(behaviour(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # every exception ends the call with a status
                await self._abort(context, e, method)

        return call

    async def _abort(self, context, exc: Exception, method: str) -> None:
        if not isinstance(exc, StatusError) and _table_code(exc, self.errors) is None:
            telemetry.logger().error("rpc.internal_error", method=method, exc_info=exc)
        trailing = exc.trailing_metadata if isinstance(exc, StatusError) else ()
        await context.abort(*status_of(exc, self.errors), trailing_metadata=trailing)


class Server:
    """A grpc.aio server with the standard health service (overall status "" plus one per service),
    reflection, and the error interceptor with ``errors``, the table of exception class -> status
    code of the services it serves."""

    def __init__(self, service_names: list[str], *, errors: ErrorTable) -> None:
        self.server = grpc.aio.server(options=_OPTIONS, interceptors=[ErrorInterceptor(errors)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )

    def bind(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listen on ``address`` ("host:port", port 0 picks one), over TLS with ``credentials``
        (``pdserve.tls.server_credentials``); returns the port."""
        if credentials is None:
            port = self.server.add_insecure_port(address)
        else:
            port = self.server.add_secure_port(address, credentials)
        if port == 0:
            raise ValueError(f"cannot listen on {address}")
        return port

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool, services: Iterable[str] | None = None) -> None:
        """The health status of ``services`` (names; "" is the server as a whole), by default
        of the whole server and every service it serves."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names] if services is None else services:
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.stop(grace)


class Gate:
    """Admits calls until closed, and counts the admitted ones not over yet: a draining server
    closes it, so new calls end with UNAVAILABLE (a caller retries elsewhere), then waits until
    the running ones are over (``wait_idle``)."""

    def __init__(self, closed_message: str) -> None:
        self.closed_message = closed_message
        self.open = True
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Hold the gate for a call; StatusError(UNAVAILABLE) once it is closed."""
        if not self.open:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, self.closed_message)
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if not self.active:
                self._idle.set()

    def close(self) -> None:
        self.open = False

    async def wait_idle(self, timeout: float) -> bool:
        """Until no admitted call runs (True), or ``timeout`` seconds pass (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def channel(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    options: list[tuple[str, str]] | None = None,
) -> grpc.aio.Channel:
    """A channel to ``address``; over TLS with ``credentials`` (``pdserve.tls``), ``options``
    added (``tls.channel_options``)."""
    opts = [*_OPTIONS, *(options or [])]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, credentials, options=opts)
