"""The error interceptor over a real grpc.aio server on a localhost port: every entry of the
services' table gives its status code and the exception's text, a StatusError its own code, an
unknown exception INTERNAL (with its traceback logged), a streaming handler that raises after
yielding delivers its messages and then the status, a request whose bytes do not decode
INVALID_ARGUMENT, and nothing hangs."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog
from pdserve.services.errors import STATUS_CODES
from pdserve.services.gateway.gateway import GatewayError
from pdserve.services.gateway.registry import LayoutMismatchError

from pdserve import rpc
from pdserve.engine import AdmissionError
from pdserve.engine_loop import EngineDeadError
from pdserve.transfer import (
    HeaderMismatchError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.v1 import generation_pb2, generation_pb2_grpc

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

# what the services raise -> the status the client gets (the codes the hand-written abort sites
# gave, one entry per line of services/errors.py, plus subclasses the table does not name)
EXPECTED = [
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (LayoutMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (HeaderMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdmissionError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TransferTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TransferError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (PeerUnreachableError, grpc.StatusCode.UNAVAILABLE),
    (UnicodeDecodeError, grpc.StatusCode.INVALID_ARGUMENT),  # a ValueError
]


def test_expected_covers_the_table():
    assert set(STATUS_CODES) <= {cls for cls, _ in EXPECTED}
    for cls, code in EXPECTED:
        if cls in STATUS_CODES:
            assert STATUS_CODES[cls] == code


def _make(cls: type[Exception], message: str) -> Exception:
    if cls is UnicodeDecodeError:
        return UnicodeDecodeError("utf-8", b"\xff", 0, 1, message)
    return cls(message)


class Raising(generation_pb2_grpc.GenerationServicer):
    """``request.text`` says what to raise; Generate yields ``request.sampling.max_tokens``
    messages first."""

    def __init__(self) -> None:
        self.errors: dict[str, BaseException] = {}
        self.closed: list[str] = []

    async def Complete(self, request, context):
        err = self.errors.get(request.text)
        if err is not None:
            raise err
        if request.text == "abort":  # a handler's own abort passes through unchanged
            await context.abort(grpc.StatusCode.NOT_FOUND, "aborted by hand")
        return generation_pb2.CompleteResponse(text="ok")

    async def Generate(self, request, context):
        try:
            for i in range(request.sampling.max_tokens):
                yield generation_pb2.GenerateResponse(token_ids=[i])
            err = self.errors.get(request.text)
            if err is not None:
                raise err
            if request.text == "hang":
                await asyncio.sleep(3600)
        finally:
            self.closed.append(request.request_id)


def serve(servicer: Raising, body, raw: bool = False):
    """Run ``body(stub)`` (``raw``: ``body(channel)``) against a server with the services' table;
    returns what it returns."""

    async def main():
        server = rpc.Server([SERVICE], errors=STATUS_CODES)
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
        port = server.bind("127.0.0.1:0")
        await server.start()
        try:
            async with rpc.channel(f"127.0.0.1:{port}") as ch:
                return await body(ch if raw else generation_pb2_grpc.GenerationStub(ch))
        finally:
            await server.stop(grace=0.5)

    return asyncio.run(asyncio.wait_for(main(), 30))


async def _unary_error(stub, text: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(generation_pb2.GenerateRequest(text=text), timeout=10)
    return err.value


@pytest.mark.parametrize("cls, code", EXPECTED, ids=[c.__name__ for c, _ in EXPECTED])
def test_each_table_entry_gives_its_code_and_the_message(cls, code):
    servicer = Raising()
    exc = _make(cls, f"{cls.__name__} happened: do this instead")
    servicer.errors["x"] = exc

    async def body(stub):
        unary = await _unary_error(stub, "x")
        call = stub.Generate(generation_pb2.GenerateRequest(text="x", request_id="s"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            async for _ in call:
                pass
        ok = await stub.Complete(generation_pb2.GenerateRequest(text="fine"), timeout=10)
        return unary, streamed.value, ok

    unary, streamed, ok = serve(servicer, body)
    for err in (unary, streamed):
        assert err.code() == code
        assert err.details() == str(exc)
    assert ok.text == "ok"  # the server keeps serving


def test_status_error_carries_its_own_code():
    servicer = Raising()
    servicer.errors["x"] = GatewayError(grpc.StatusCode.NOT_FOUND, "model 'm' is not served here")
    err = serve(servicer, lambda stub: _unary_error(stub, "x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "model 'm' is not served here"


def test_a_handlers_own_abort_passes_through():
    err = serve(Raising(), lambda stub: _unary_error(stub, "abort"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "aborted by hand"


def test_unknown_exception_is_internal_and_logged():
    servicer = Raising()
    servicer.errors["x"] = KeyError("no such slot")
    with structlog.testing.capture_logs() as logs:
        err = serve(servicer, lambda stub: _unary_error(stub, "x"))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "internal error: KeyError: 'no such slot'"
    [entry] = [e for e in logs if e["event"] == "rpc.internal_error"]
    assert entry["method"] == f"/{SERVICE}/Complete"
    assert entry["exc_info"] is servicer.errors["x"]
    assert entry["log_level"] == "error"


def test_known_exceptions_are_not_logged_as_internal():
    servicer = Raising()
    servicer.errors["x"] = ValueError("bad")
    with structlog.testing.capture_logs() as logs:
        serve(servicer, lambda stub: _unary_error(stub, "x"))
    assert not [e for e in logs if e["event"] == "rpc.internal_error"]


@pytest.mark.parametrize(
    "exc, code",
    [
        (TransferTimeoutError("3 of 30 layers arrived"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (RuntimeError("engine thread died"), grpc.StatusCode.INTERNAL),
    ],
)
def test_stream_raising_after_yielding_delivers_messages_then_status(exc, code):
    servicer = Raising()
    servicer.errors["x"] = exc

    async def body(stub):
        got = []
        call = stub.Generate(
            generation_pb2.GenerateRequest(text="x", request_id="s", sampling={"max_tokens": 3}),
            timeout=10,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for msg in call:
                got.extend(msg.token_ids)
        return got, err.value

    got, err = serve(servicer, body)
    assert got == [0, 1, 2]
    assert err.code() == code
    assert str(exc) in err.details()
    assert servicer.closed == ["s"]  # the handler's finally ran


def test_cancelled_stream_closes_the_handler():
    """A client that goes away mid-stream: the handler's finally runs (it frees what the call
    held), no status is made up."""
    servicer = Raising()

    async def body(stub):
        call = stub.Generate(
            generation_pb2.GenerateRequest(text="hang", request_id="c", sampling={"max_tokens": 1}),
            timeout=10,
        )
        assert (await call.read()).token_ids == [0]
        call.cancel()
        for _ in range(100):
            if servicer.closed:
                break
            await asyncio.sleep(0.05)
        return await call.code()

    assert serve(servicer, body) == grpc.StatusCode.CANCELLED
    assert servicer.closed == ["c"]


def test_a_long_message_is_cut():
    servicer = Raising()
    servicer.errors["x"] = ValueError("stop strings must be short, got " + "x" * 100_000)
    err = serve(servicer, lambda stub: _unary_error(stub, "x"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.details()) == rpc.MAX_STATUS_MESSAGE_CHARS
    assert err.details().startswith("stop strings must be short, got xxx")
    assert err.details().endswith("...")


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\xff\xff\xff", "Wire format was corrupt"),
        (b"\x12\x02\xff\xfe", "String field had bad UTF-8"),  # text = invalid UTF-8
    ],
)
def test_bytes_that_do_not_decode_are_invalid_argument_and_the_handler_is_not_called(raw, why):
    servicer = Raising()

    async def body(ch):
        errors = []  # methods without serializers: the server's parser gets ``raw``
        for method, kind in (("Complete", ch.unary_unary), ("Generate", ch.unary_stream)):
            call = kind(f"/{SERVICE}/{method}")(raw, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if method == "Complete":
                    await call
                else:
                    async for _ in call:
                        pass
            errors.append(err.value)
        stub = generation_pb2_grpc.GenerationStub(ch)
        ok = await stub.Complete(generation_pb2.GenerateRequest(text="fine"), timeout=10)
        return errors, ok

    errors, ok = serve(servicer, body, raw=True)
    for err in errors:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("the request does not decode: ")
        assert "pdserve.v1.GenerateRequest" in err.details() and why in err.details()
    assert servicer.closed == []  # Generate's handler never ran
    assert ok.text == "ok"


def test_server_requires_a_table():
    with pytest.raises(TypeError):
        rpc.Server([SERVICE])  # type: ignore[call-arg]
