"""A gateway request, used ``with``, is accounted with the status its client gets (the same table
the server's error interceptor reads), and counted as running until then."""

from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import pytest
from pdserve.services.gateway.gateway import Gateway, GatewayError

from pdserve.tokenizer import Tokenizer
from pdserve.transfer import TransferError


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tokenizer.from_folder(default_model_dir)


def running(gw: Gateway) -> float:
    return gw.metrics.registry.get_sample_value("pdserve_requests_running")


def outcomes(gw: Gateway) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for m in gw.metrics.registry.collect()
        if m.name == "pdserve_requests"
        for s in m.samples
        if s.name == "pdserve_requests_total"
    }


@pytest.mark.parametrize(
    "exc, outcome",
    [
        (None, "ok"),
        (ValueError("max_tokens must be an integer >= 1, got 0"), "invalid_argument"),
        (GatewayError(grpc.StatusCode.NOT_FOUND, "model 'x' is not served here"), "not_found"),
        (TransferError("peer gone"), "unavailable"),
        (RuntimeError("a bug"), "internal"),
        (asyncio.CancelledError(), "cancelled"),
        (GeneratorExit(), "cancelled"),
    ],
)
def test_request_is_closed_with_the_clients_status(tok, exc, outcome):
    gw = Gateway(tok, 8192, tok.vocab_size, "m")
    ctx = gw.open("", (), stream=True)
    assert re.fullmatch(r"gw-[0-9a-f]{6}-0", ctx.request_id)
    assert running(gw) == 1
    with pytest.raises(type(exc)) if exc is not None else contextlib.nullcontext():
        with ctx:
            if exc is not None:
                raise exc
    assert outcomes(gw) == {outcome: 1.0}
    assert running(gw) == 0


def test_check_model(tok):
    gw = Gateway(tok, 8192, tok.vocab_size, "SmolLM2")
    gw.check_model("")
    gw.check_model("SmolLM2")
    with pytest.raises(GatewayError) as err:
        gw.check_model("gpt-17")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert str(err.value) == "model 'gpt-17' is not served here; available: 'SmolLM2'"
