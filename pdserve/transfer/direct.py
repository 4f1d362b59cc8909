"""Direct transfers, the sender's part: a transport that can send a transfer straight from the
sender's pools into the receiver's blocks (plan.py) has a ``DirectPath`` (``KVTransport.direct``);
one that cannot has None there, and its transfers go framed (gathered into message buffers).

``SendTransfer.send_pool_layer`` drives it, once per transfer whose destination block ids the
sender was given:

    plan = direct.start(peer, ...)        None: send framed. Else the plan message is on its way
    direct.send_layer(peer, plan, i, ...) per layer, from the pools (kept unchanged until wait)
    direct.send_trailer(peer, plan, hdr)  the last layer's header, with the first sampled token

The receiver needs nothing for it beyond a ``PoolDestination`` (pool_copy.py): a transport lands
a direct transfer in those pools itself, or, for any other destination, stages it per layer.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.transfer.header import LayerHeader

if TYPE_CHECKING:
    from pdserve.transfer.base import PeerHandle


class DirectPlan:
    """A ``DirectPath``'s plan for one transfer: what its messages are, made by ``start``."""

    transfer_id: int
    plan_nbytes: int  # the plan message
    layer_nbytes: int  # K and V of one layer, in all its data messages


class DirectPath(ABC):
    """Sends a transfer's layers straight from the sender's pools. Called from one thread per
    transfer (the engine's); the futures complete when the receiver has taken each message, or
    fail with TransferTimeoutError after ``timeout`` s or PeerUnreachableError."""

    @abstractmethod
    def start(
        self,
        peer: PeerHandle,
        transfer_id: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        traceparent: str,
        timeout: float,
    ) -> tuple[DirectPlan, concurrent.futures.Future[None]] | None:
        """At the transfer's first layer: plan it from its source blocks (in pools like
        ``k_pool``/``v_pool``) to the receiver's ``dst_block_ids`` and send the plan; returns it
        with the plan message's future, or None when the transfer cannot go direct (destination
        too fragmented, pools this path does not cover): then it goes framed."""

    @abstractmethod
    def send_layer(
        self,
        peer: PeerHandle,
        plan: DirectPlan,
        layer: int,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        timeout: float,
    ) -> list[concurrent.futures.Future[None]]:
        """Send layer ``layer`` of the planned blocks from ``k_pool``/``v_pool``; returns at once,
        one future per message. The blocks must stay unchanged until the futures are done."""

    @abstractmethod
    def send_trailer(
        self, peer: PeerHandle, plan: DirectPlan, header: LayerHeader, timeout: float
    ) -> concurrent.futures.Future[None]:
        """After the last layer: the header of the last layer, carrying the first token."""
