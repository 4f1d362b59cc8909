"""KV transfer between workers: the interface in ``base``, implementations picked by name here."""

from __future__ import annotations

from typing import Any

from pdserve.transfer.base import (
    HeaderMismatchError,
    KVTransport,
    LayerCallback,
    PeerHandle,
    PeerUnreachableError,
    RecvTransfer,
    SendTransfer,
    TransferError,
    TransferStats,
    TransferTimeoutError,
    gather_into,
    scatter_into,
)
from pdserve.transfer.header import KVLayout, LayerHeader, kv_layout_hash

TRANSPORTS = ("ucx", "loopback", "nccl")

__all__ = [
    "TRANSPORTS",
    "HeaderMismatchError",
    "KVLayout",
    "KVTransport",
    "LayerCallback",
    "LayerHeader",
    "PeerHandle",
    "PeerUnreachableError",
    "RecvTransfer",
    "SendTransfer",
    "TransferError",
    "TransferStats",
    "TransferTimeoutError",
    "create_transport",
    "gather_into",
    "kv_layout_hash",
    "scatter_into",
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
        from pdserve.transfer.nccl import NCCLTransport

        return NCCLTransport(layout, **options)
    raise ValueError(f"unknown KV transport {kind!r}; use one of: {', '.join(TRANSPORTS)}")
