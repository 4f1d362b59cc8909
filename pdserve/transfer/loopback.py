"""In-process KV transport for unit tests of other components: same interface, same framing and
checks as UCX, but a send is a copy into the receiver's inbox. Nothing crosses a process.

Transports find each other through a process-wide registry keyed by their address. Messages for a
transfer that is not expected yet are kept until it is (as UCX's unexpected queue does); messages
for a transfer that is over (completed or failed: its reservation's generation is gone) are
dropped and counted as stale (fence.py). A message lands whole on the receiver's loop thread, so
a transfer settles as soon as it is over. Transfer state runs on the receiver's loop thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from dataclasses import dataclass

import torch

from pdserve.transfer.base import KVTransport, PeerHandle, check_layer
from pdserve.transfer.errors import PeerUnreachableError, TransferError
from pdserve.transfer.fence import BlockFence
from pdserve.transfer.header import (
    KVLayout,
    LayerHeader,
    pack_address,
    unpack_address,
    write_message,
)
from pdserve.transfer.loop import LoopThread
from pdserve.transfer.pool_copy import KVDestination
from pdserve.transfer.recv_transfer import RecvTransfer

_registry: dict[bytes, LoopbackTransport] = {}
_registry_lock = threading.Lock()
_ids = itertools.count()


@dataclass(eq=False)
class LoopbackPeer(PeerHandle):
    target: LoopbackTransport | None = None


class LoopbackTransport(KVTransport):
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._loop = LoopThread("pdserve-loopback")
        self._closed = False
        self._recvs: dict[int, RecvTransfer] = {}
        self._unexpected: dict[int, list[torch.Tensor]] = {}
        self._over: set[int] = set()  # transfer ids (generations) that are over: never reused
        self.fence = BlockFence()
        self._raw_address = f"loopback-{next(_ids)}".encode()
        with _registry_lock:
            _registry[self._raw_address] = self

    # -- receiver -----------------------------------------------------------------------------

    def address(self) -> bytes:
        return pack_address(self.layout, self._raw_address)

    def expect(self, transfer_id: int, destination: KVDestination, timeout: float) -> RecvTransfer:
        transfer = RecvTransfer(self.layout, transfer_id, destination, timeout, self._loop.loop)
        self.fence.claim(transfer)
        try:
            self._call(self._start_recv, transfer)
        except BaseException:
            self.fence.release(transfer)
            raise
        return transfer

    def _start_recv(self, transfer: RecvTransfer) -> None:
        tid = transfer.transfer_id
        if self._closed:
            raise TransferError("transport closed")
        if tid in self._recvs or tid in self._over:
            raise ValueError(f"transfer id {tid} is in use (or was)")
        self._recvs[tid] = transfer
        transfer.start(self._recv_finished)
        for message in self._unexpected.pop(tid, []):
            self._deliver(tid, message)

    def _recv_finished(self, transfer: RecvTransfer) -> None:
        self._recvs.pop(transfer.transfer_id, None)
        self._over.add(transfer.transfer_id)

    def _deliver(self, tid: int, message: torch.Tensor) -> None:
        """``tid`` travels beside the message, as UCX's tag does: a header may be unreadable."""
        transfer = self._recvs.get(tid)
        if transfer is not None:
            transfer.deliver(message)
        elif tid in self._over:
            self.fence.count_stale()  # its reservation is over: fenced off, dropped
        else:
            self._unexpected.setdefault(tid, []).append(message)

    # -- sender -------------------------------------------------------------------------------

    def connect(self, peer_address: bytes) -> LoopbackPeer:
        raw = unpack_address(peer_address, self.layout)
        with _registry_lock:
            target = _registry.get(raw)
        if target is None:
            raise PeerUnreachableError(f"no loopback transport at {raw!r}")
        return LoopbackPeer(address=peer_address, target=target)

    def send_layer(
        self,
        peer: PeerHandle,
        header: LayerHeader,
        k: torch.Tensor,
        v: torch.Tensor,
        timeout: float,
    ) -> concurrent.futures.Future[None]:
        if not isinstance(peer, LoopbackPeer):
            raise TypeError(f"peer handle {peer!r} was not made by LoopbackTransport.connect")
        check_layer(self.layout, header, k, v)
        if self._closed:
            raise TransferError("transport closed")
        message = torch.empty(self.layout.message_nbytes(header.num_blocks), dtype=torch.uint8)
        write_message(message, header, k.cpu(), v.cpu())
        result: concurrent.futures.Future[None] = concurrent.futures.Future()
        target = peer.target
        if not peer.alive or target is None or target._closed:
            result.set_exception(PeerUnreachableError("loopback receiver is closed"))
            return result
        try:
            target._loop.call_soon(target._deliver, header.transfer_id, message)
        except RuntimeError:
            result.set_exception(PeerUnreachableError("loopback receiver is closed"))
        else:
            result.set_result(None)
        return result

    def disconnect(self, peer: PeerHandle) -> None:
        peer.alive = False

    def close(self) -> None:
        if self._closed:
            return
        with _registry_lock:
            _registry.pop(self._raw_address, None)
        if self._loop.running:
            self._loop.call(self._shutdown)
        self._loop.stop()

    def _shutdown(self) -> None:
        self._closed = True
        for transfer in list(self._recvs.values()):
            transfer.fail(TransferError(f"transfer {transfer.transfer_id}: transport closed"))
        self._unexpected.clear()

    def _call(self, fn: object, *args: object) -> None:
        if not self._loop.running:
            raise TransferError("transport closed")
        self._loop.call(fn, *args)  # type: ignore[arg-type]
