"""A worker's KV transport is made for the engine's device: ``--device cuda`` puts the UCX
message buffers (and its CUDA context) where the KV pools are. The transfer over CUDA memory
itself is tested, marked gpu, in tests/transfer/test_transfer_gpu.py and
tests/engine/test_disaggregated_engine.py."""

from __future__ import annotations

import pytest
from pdserve.services import cli as serve_cli
from pdserve.services.main import WorkerOptions, _transport_options

from pdserve.cli import build_parser
from pdserve.transfer import create_transport
from tests.transfer.peers import default_layout


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_ucx_transport_options_carry_the_engine_device(role: str, device: str) -> None:
    engine = serve_cli.engine_config(build_parser().parse_args([role, "--device", device]))
    options = _transport_options(WorkerOptions(role=role, engine=engine, transport="ucx"))
    assert options["device"] == device
    assert ("liveness_advertise" in options) == (role == "decode")


def test_loopback_takes_no_device_options() -> None:
    engine = serve_cli.engine_config(build_parser().parse_args(["decode", "--device", "cuda"]))
    assert _transport_options(WorkerOptions("decode", engine, transport="loopback")) == {}


def test_sends_gather_on_the_transport_device_unless_told() -> None:
    """``start_send`` without ``device`` gathers where the transport's buffers are."""
    engine = serve_cli.engine_config(build_parser().parse_args(["prefill"]))
    options = _transport_options(WorkerOptions("prefill", engine, transport="ucx"))
    with create_transport("ucx", default_layout(), **options) as transport:
        assert transport.device.type == "cpu"
        peer = transport.connect(transport.address())
        tx = transport.start_send(peer, 1, 2, timeout=5.0)
        assert tx.device == transport.device
        assert transport.start_send(peer, 2, 2, timeout=5.0, device="meta").device.type == "meta"
