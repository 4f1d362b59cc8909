"""KV transfer between workers: the interface in ``base``, implementations picked by name here.

base.py             KVTransport (the interface), PeerHandle
pool_copy.py        where a transfer lands (PoolDestination, CallbackDestination); the copies
                    between messages and pools (the kernels' gather_kv_blocks, kv_block_writer)
recv_transfer.py    RecvTransfer: one transfer on the receiver, checked and accounted
send_transfer.py    SendTransfer: one transfer on the sender, framed or direct
direct.py           DirectPath: sending straight from the sender's pools (KVTransport.direct)
stats.py, errors.py TransferStats; TransferError and its kinds
header.py, plan.py  the wire format: layout, message header, address; a direct plan's messages
ucx*.py             the UCX transport (the default); loopback.py: in-process, for tests
experimental/       NCCL, not wired to any service
"""

from __future__ import annotations

from typing import Any

from pdserve.transfer.base import KVTransport, PeerHandle
from pdserve.transfer.direct import DirectPath
from pdserve.transfer.errors import (
    HeaderMismatchError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.header import KVLayout, LayerHeader, kv_layout_hash
from pdserve.transfer.pool_copy import (
    CallbackDestination,
    KVDestination,
    LayerCallback,
    PoolDestination,
    gather_into,
)
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.send_transfer import SendTransfer
from pdserve.transfer.stats import TransferStats, TransportCounters

TRANSPORTS = ("ucx", "loopback")

__all__ = [
    "TRANSPORTS",
    "CallbackDestination",
    "DirectPath",
    "HeaderMismatchError",
    "KVDestination",
    "KVLayout",
    "KVTransport",
    "LayerCallback",
    "LayerHeader",
    "PeerHandle",
    "PeerUnreachableError",
    "PoolDestination",
    "RecvTransfer",
    "SendTransfer",
    "TransferError",
    "TransferStats",
    "TransportCounters",
    "TransferTimeoutError",
    "create_transport",
    "gather_into",
    "kv_layout_hash",
]


def create_transport(kind: str, layout: KVLayout, **options: Any) -> KVTransport:
    """``kind`` is one of TRANSPORTS; ``options`` go to that implementation's constructor."""
    if kind == "ucx":
        from pdserve.transfer.ucx import UCXTransport

        return UCXTransport(layout, **options)
    if kind == "loopback":
        from pdserve.transfer.loopback import LoopbackTransport

        return LoopbackTransport(layout, **options)
    if kind == "nccl":
        raise ValueError(
            "the NCCL KV transport is experimental and not wired to any service (its handshake "
            "has no RPC, and it has never moved KV between two processes); use ucx, which moves "
            "GPU memory too. To try it directly: pdserve.transfer.experimental.nccl.NCCLTransport"
        )
    raise ValueError(f"unknown KV transport {kind!r}; use one of: {', '.join(TRANSPORTS)}")
