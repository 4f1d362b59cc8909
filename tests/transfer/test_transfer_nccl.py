"""NCCL: what runs without a GPU (library, unique id, handshake, framing) and, marked gpu, what
needs one. Two NCCL ranks cannot share a GPU, so no test here moves KV between two processes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.transfer import HeaderMismatchError, LayerHeader
from pdserve.transfer.experimental.nccl import (
    NCCLTransport,
    check_hello,
    make_reply,
    recv_frames,
    send_frames,
)
from pdserve.transfer.experimental.nccl_lib import (
    UNIQUE_ID_BYTES,
    NCCLError,
    NCCLLibrary,
    find_libnccl,
)
from pdserve.transfer.header import HEADER_NBYTES, pack_address, read_header, write_message
from tests.gpu import NEEDS_CUDA
from tests.transfer.peers import default_layout, layer_kv


@pytest.fixture(scope="module")
def lib() -> NCCLLibrary:
    try:
        return NCCLLibrary()
    except NCCLError as exc:  # not a dependency: 470 MB, and only GPU deployments need it
        pytest.skip(f"no libnccl.so.2 here ({exc})")


def test_library_loads(lib: NCCLLibrary) -> None:
    assert lib.path == find_libnccl()
    if importlib.util.find_spec("nvidia") and importlib.util.find_spec("nvidia.nccl"):
        assert lib.path.endswith("nvidia/nccl/lib/libnccl.so.2")  # the wheel's, when installed
    major, minor, _ = lib.version()
    assert (major, minor) >= (2, 18)


def test_unique_ids_are_fresh_128_byte_blobs(lib: NCCLLibrary) -> None:
    a, b = lib.unique_id(), lib.unique_id()
    assert len(a) == len(b) == UNIQUE_ID_BYTES and a != b


class StubReceiver:
    """The decode side of the handshake, as the decode servicer would run it, minus the GPU."""

    def __init__(self, layout_model: str = "SmolLM2-135M") -> None:
        self.transport = NCCLTransport(default_layout(model=layout_model), device="cpu")
        self.unique_ids: list[bytes] = []

    def __call__(self, address: bytes, hello: bytes) -> bytes:
        try:
            rid = self.transport._receiver_id  # noqa: SLF001 - what accept() checks against
            self.unique_ids.append(check_hello(hello, self.transport.layout, rid))
        except HeaderMismatchError as exc:
            return make_reply(str(exc))
        return make_reply()


def test_handshake_delivers_the_unique_id() -> None:
    stub = StubReceiver()
    sender = NCCLTransport(default_layout(), device="cpu", handshake=stub)
    try:
        unique_id = sender.handshake_with(stub.transport.address())
        assert stub.unique_ids == [unique_id] and len(unique_id) == UNIQUE_ID_BYTES
    finally:
        sender.close()
        stub.transport.close()


def test_handshake_refusals_are_clear() -> None:
    stub = StubReceiver()
    other = NCCLTransport(default_layout(model="another-model"), device="cpu", handshake=stub)
    stale = NCCLTransport(default_layout(), device="cpu", handshake=stub)
    try:
        with pytest.raises(HeaderMismatchError, match="same model, dtype, block size"):
            other.handshake_with(stub.transport.address())  # refused from the address alone
        forged = pack_address(stale.layout, b"nccl" + b"\0" * 16)  # another receiver's id
        with pytest.raises(HeaderMismatchError, match="refused: hello is addressed to another"):
            stale.handshake_with(forged)
    finally:
        for t in (other, stale, stub.transport):
            t.close()


class PipeNCCL:
    """Stands in for NCCL point-to-point: sends queue bytes, receives take them in order."""

    def __init__(self) -> None:
        self.queue: list[bytes] = []
        self.calls: list[tuple[str, int]] = []

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        import ctypes

        self.queue.append(ctypes.string_at(ptr, nbytes))
        self.calls.append(("send", nbytes))

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        import ctypes

        data = self.queue.pop(0)
        assert len(data) == nbytes, "NCCL needs equal counts on both sides"
        ctypes.memmove(ptr, data, nbytes)
        self.calls.append(("recv", nbytes))


class HostStream:
    cuda_stream = 0

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_framing_header_then_sized_payload(dtype: torch.dtype) -> None:
    layout = default_layout(dtype)
    nccl = PipeNCCL()
    for tid, num_blocks in ((1, 32), (2, 5)):  # messages of different sizes, back to back
        k, v = layer_kv(layout, num_blocks, tid, 3)
        header = LayerHeader.for_layer(layout, tid, 3, num_blocks)
        buf = torch.empty(layout.message_nbytes(num_blocks), dtype=torch.uint8)
        write_message(buf, header, k, v)
        send_frames(nccl, 0, 1, buf, HostStream())  # type: ignore[arg-type]
    for tid, num_blocks in ((1, 32), (2, 5)):
        got = recv_frames(nccl, 0, 0, layout, torch.device("cpu"), HostStream())  # type: ignore[arg-type]
        assert read_header(got).transfer_id == tid
        k, v = layer_kv(layout, num_blocks, tid, 3)
        want = torch.cat([k.view(torch.uint8).flatten(), v.view(torch.uint8).flatten()])
        assert torch.equal(got[HEADER_NBYTES:], want)
    payload = layout.message_nbytes(5) - HEADER_NBYTES
    assert nccl.calls[-2:] == [("recv", HEADER_NBYTES), ("recv", payload)]


@pytest.mark.gpu
@NEEDS_CUDA
def test_one_rank_communicator_moves_a_layer_to_itself(lib: NCCLLibrary) -> None:
    """The ctypes signatures of init, send and recv on a real GPU: a rank sending to itself
    (grouped, as NCCL requires for self-sends)."""
    layout = default_layout(torch.bfloat16)
    comm = lib.comm_init_rank(1, lib.unique_id(), 0)
    try:
        k, v = layer_kv(layout, 32, 1, 0)
        src = torch.empty(layout.message_nbytes(32), dtype=torch.uint8, device="cuda")
        write_message(src, LayerHeader.for_layer(layout, 1, 0, 32), k.cuda(), v.cuda())
        dst = torch.zeros_like(src)
        stream = torch.cuda.current_stream().cuda_stream
        lib._lib.ncclGroupStart()  # noqa: SLF001
        lib.send(src.data_ptr(), src.numel(), 0, comm, stream)
        lib.recv(dst.data_ptr(), dst.numel(), 0, comm, stream)
        lib._lib.ncclGroupEnd()  # noqa: SLF001
        torch.cuda.synchronize()
        assert torch.equal(src, dst)
    finally:
        lib.destroy(comm)
