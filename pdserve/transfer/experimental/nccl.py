"""KV transport over NCCL, GPU to GPU: one two-rank communicator per (prefill, decode) pair.

EXPERIMENTAL: not wired to any service (see ``experimental/__init__.py``); ``create_transport``
refuses "nccl". Construct ``NCCLTransport`` directly to try it.

WHAT RAN, AND WHAT DID NOT. On the CPU-only machines this was written on: loading libnccl.so.2
from the nvidia-nccl-cu12 wheel, ncclGetVersion, ncclGetUniqueId, the handshake messages against
a stub peer, and the framing of a layer into header and payload buffers. NOT RUN: creating a
communicator (ncclCommInitRank fails without a GPU driver), ncclSend/ncclRecv on CUDA streams,
and therefore this whole transport end to end. NCCL cannot put two ranks on one GPU, so the lent
one-GPU machines cannot run it between two processes either. Its GPU tests are
``@pytest.mark.gpu``. UCX (ucx.py) moves GPU memory too (cuda_copy/cuda_ipc) and is tested.

Handshake. NCCL needs its 128-byte unique id delivered out of band. The sender makes one and
sends a hello (protocol version, layout hash, unique id) through the ``handshake`` callable the
services provide (a gRPC call to the decode worker, which hands it to ``accept``). The receiver
checks it, answers, and both sides join the communicator: sender rank 0, receiver rank 1.

Framing. NCCL point-to-point has no tags and needs equal counts on both sides, so each layer goes
as two sends on one stream: the 256-byte header, then the payload (K and V) whose size the header
gives. The receiver's thread per communicator receives a header, reads it on the host, receives
the payload and hands it to the transfer the header names; transfers from one sender may
interleave freely since every message says whose it is.

Deadlines. A communicator init that does not complete (the peer never joins) fails ``connect``
after ``connect_timeout``; its thread stays blocked in NCCL. A send not completed by its deadline
aborts the communicator (ncclCommAbort, which unblocks the receiver thread too): the peer is gone.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.transfer.base import KVTransport, PeerHandle, check_layer
from pdserve.transfer.errors import (
    HeaderMismatchError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.experimental.nccl_lib import UNIQUE_ID_BYTES, NCCLLibrary
from pdserve.transfer.header import (
    HEADER_NBYTES,
    PROTOCOL_VERSION,
    KVLayout,
    LayerHeader,
    pack_address,
    read_header,
    unpack_address,
    write_message,
)
from pdserve.transfer.loop import LoopThread
from pdserve.transfer.pool_copy import KVDestination
from pdserve.transfer.recv_transfer import RecvTransfer

HELLO = struct.Struct(f"<4sH16s16s{UNIQUE_ID_BYTES}s")  # magic, version, layout, receiver, id
HELLO_MAGIC, REPLY_MAGIC = b"PDNH", b"PDNR"
SENDER_RANK, RECEIVER_RANK = 0, 1

Handshake = Callable[[bytes, bytes], bytes]  # (peer address, hello) -> reply, e.g. over gRPC


def make_hello(layout: KVLayout, receiver_id: bytes, unique_id: bytes) -> bytes:
    return HELLO.pack(
        HELLO_MAGIC, PROTOCOL_VERSION, bytes.fromhex(layout.compat_hash), receiver_id, unique_id
    )


def check_hello(hello: bytes, layout: KVLayout, receiver_id: bytes) -> bytes:
    """The unique id in ``hello``; HeaderMismatchError if it is not for this receiver's layout."""
    if len(hello) != HELLO.size or hello[:4] != HELLO_MAGIC:
        raise HeaderMismatchError("not a pdserve NCCL hello")
    _, version, lhash, rid, unique_id = HELLO.unpack(hello)
    if version != PROTOCOL_VERSION:
        raise HeaderMismatchError(
            f"peer speaks KV protocol v{version}, this worker v{PROTOCOL_VERSION}"
        )
    if lhash.hex() != layout.compat_hash:
        raise HeaderMismatchError(
            f"peer KV layout hash {lhash.hex()} differs from this worker's {layout.compat_hash}"
        )
    if rid != receiver_id:
        raise HeaderMismatchError("hello is addressed to another receiver (stale address?)")
    return unique_id


def make_reply(error: str = "") -> bytes:
    return REPLY_MAGIC + error.encode()


def check_reply(reply: bytes) -> None:
    if reply[:4] != REPLY_MAGIC:
        raise PeerUnreachableError("the NCCL receiver gave no valid handshake reply")
    if reply[4:]:
        raise HeaderMismatchError(f"the NCCL receiver refused: {reply[4:].decode()}")


def send_frames(lib: NCCLLibrary, comm: int, peer: int, buf: torch.Tensor, stream: Any) -> None:
    """Enqueue one message (``[header | K | V]`` on the GPU) as header, then payload."""
    lib.send(buf.data_ptr(), HEADER_NBYTES, peer, comm, stream.cuda_stream)
    lib.send(
        buf.data_ptr() + HEADER_NBYTES, buf.numel() - HEADER_NBYTES, peer, comm, stream.cuda_stream
    )


def recv_frames(
    lib: NCCLLibrary, comm: int, peer: int, layout: KVLayout, device: torch.device, stream: Any
) -> torch.Tensor:
    """Receive one message: its header first (to learn its size), then its payload."""
    head = torch.empty(HEADER_NBYTES, dtype=torch.uint8, device=device)
    lib.recv(head.data_ptr(), HEADER_NBYTES, peer, comm, stream.cuda_stream)
    stream.synchronize()
    header = read_header(head)
    buf = torch.empty(layout.message_nbytes(header.num_blocks), dtype=torch.uint8, device=device)
    buf[:HEADER_NBYTES].copy_(head)
    lib.recv(
        buf.data_ptr() + HEADER_NBYTES, buf.numel() - HEADER_NBYTES, peer, comm, stream.cuda_stream
    )
    stream.synchronize()
    return buf


@dataclass(eq=False)
class NCCLPeer(PeerHandle):
    comm: int = 0
    stream: Any = None
    sends: concurrent.futures.ThreadPoolExecutor | None = None  # one message at a time, in order


class NCCLTransport(KVTransport):
    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str | torch.device = "cuda",
        handshake: Handshake | None = None,
        connect_timeout: float = 30.0,
        library: NCCLLibrary | None = None,
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.handshake = handshake
        self.connect_timeout = connect_timeout
        self.lib = library or NCCLLibrary()
        self._receiver_id = os.urandom(16)
        self._loop = LoopThread("pdserve-nccl")
        self._recvs: dict[int, RecvTransfer] = {}
        self._comms: list[int] = []
        self._closed = False

    # -- receiver -----------------------------------------------------------------------------

    def address(self) -> bytes:
        return pack_address(self.layout, b"nccl" + self._receiver_id)

    def accept(self, hello: bytes) -> bytes:
        """Called by the decode servicer with a sender's hello; joins its communicator in the
        background and returns the reply for the sender (an error text if refused)."""
        try:
            unique_id = check_hello(hello, self.layout, self._receiver_id)
        except HeaderMismatchError as exc:
            return make_reply(str(exc))
        threading.Thread(target=self._serve, args=(unique_id,), daemon=True).start()
        return make_reply()

    def _serve(self, unique_id: bytes) -> None:
        torch.cuda.set_device(self.device)
        comm = self.lib.comm_init_rank(2, unique_id, RECEIVER_RANK)
        self._comms.append(comm)
        stream = torch.cuda.Stream(self.device)
        while not self._closed:
            try:
                buf = recv_frames(self.lib, comm, SENDER_RANK, self.layout, self.device, stream)
            except Exception:  # noqa: BLE001 - aborted or the peer died: this comm is done
                return
            self._loop.call_soon(self._deliver, buf)

    def _deliver(self, buf: torch.Tensor) -> None:
        transfer = self._recvs.get(read_header(buf).transfer_id)
        if transfer is not None:
            transfer.deliver(buf)

    def expect(self, transfer_id: int, destination: KVDestination, timeout: float) -> RecvTransfer:
        transfer = RecvTransfer(self.layout, transfer_id, destination, timeout, self._loop.loop)
        self._loop.call(self._start_recv, transfer)
        return transfer

    def _start_recv(self, transfer: RecvTransfer) -> None:
        if transfer.transfer_id in self._recvs:
            raise ValueError(f"transfer id {transfer.transfer_id} is in use")
        self._recvs[transfer.transfer_id] = transfer
        transfer.start(lambda t: self._recvs.pop(t.transfer_id, None))

    # -- sender -------------------------------------------------------------------------------

    def handshake_with(self, peer_address: bytes) -> bytes:
        """Send our hello to the receiver; returns the unique id both sides then join with."""
        raw = unpack_address(peer_address, self.layout)
        if not raw.startswith(b"nccl"):
            raise HeaderMismatchError("peer address is not an NCCL KV receiver")
        if self.handshake is None:
            raise TransferError("NCCLTransport needs a handshake callable to reach receivers")
        unique_id = self.lib.unique_id()
        check_reply(self.handshake(peer_address, make_hello(self.layout, raw[4:], unique_id)))
        return unique_id

    def connect(self, peer_address: bytes) -> NCCLPeer:
        unique_id = self.handshake_with(peer_address)
        joined: concurrent.futures.Future[int] = concurrent.futures.Future()

        def join() -> None:
            try:
                torch.cuda.set_device(self.device)
                joined.set_result(self.lib.comm_init_rank(2, unique_id, SENDER_RANK))
            except Exception as exc:  # noqa: BLE001 - handed to connect
                joined.set_exception(exc)

        threading.Thread(target=join, daemon=True).start()
        try:
            comm = joined.result(self.connect_timeout)
        except concurrent.futures.TimeoutError:
            raise PeerUnreachableError("the NCCL receiver did not join in time") from None
        self._comms.append(comm)
        sends = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdserve-nccl-send")
        return NCCLPeer(peer_address, comm=comm, stream=torch.cuda.Stream(self.device), sends=sends)

    def send_layer(
        self,
        peer: PeerHandle,
        header: LayerHeader,
        k: torch.Tensor,
        v: torch.Tensor,
        timeout: float,
    ) -> concurrent.futures.Future[None]:
        if not isinstance(peer, NCCLPeer) or peer.sends is None:
            raise TypeError(f"peer handle {peer!r} was not made by NCCLTransport.connect")
        check_layer(self.layout, header, k, v)
        if not peer.alive:
            raise PeerUnreachableError("peer was disconnected; connect again")
        nbytes = self.layout.message_nbytes(header.num_blocks)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        write_message(buf, header, k, v)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the copies into buf
        deadline = time.monotonic() + timeout
        return peer.sends.submit(self._send, peer, buf, ready, deadline, header.layer)

    def _send(
        self, peer: NCCLPeer, buf: torch.Tensor, ready: Any, deadline: float, layer: int
    ) -> None:
        if not peer.alive:
            raise PeerUnreachableError("peer was disconnected; connect again")
        peer.stream.wait_event(ready)
        send_frames(self.lib, peer.comm, RECEIVER_RANK, buf, peer.stream)
        done = torch.cuda.Event()
        done.record(peer.stream)
        while not done.query():  # NCCL offers no timeout: poll, and abort a dead peer
            if time.monotonic() > deadline:
                self.disconnect(peer)
                raise TransferTimeoutError(f"layer {layer}: not taken by the receiver in time")
            time.sleep(0.0002)

    def disconnect(self, peer: PeerHandle) -> None:
        if isinstance(peer, NCCLPeer) and peer.alive:
            peer.alive = False
            self.lib.abort(peer.comm)
            if peer.sends is not None:
                peer.sends.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for comm in self._comms:
            self.lib.abort(comm)
        if self._loop.running:
            self._loop.call(self._fail_all)
        self._loop.stop()

    def _fail_all(self) -> None:
        for transfer in list(self._recvs.values()):
            transfer.fail(TransferError(f"transfer {transfer.transfer_id}: transport closed"))
