"""Fenced KV blocks on the receiver: which transfer may still write each block, and what was
fenced off (docs/architecture.md, "Fenced KV blocks").

A transfer's id is the *generation* of the reservation it lands in: the decode worker draws it
from its block allocator's counter, which only grows, so a generation is never used twice. Every
message of the transfer echoes it (UCX tag, header). A message whose transfer is over (completed,
failed, cancelled: its reservation freed or about to be) matches no receive into the pools any
more; the transport drops it and counts it here (``stale_messages``).

``BlockFence`` adds the check against a block's current owner: from ``expect`` until the
transfer has *settled* (``RecvTransfer.settled``: no receive into its blocks is under way any
more) its blocks belong to it, and ``claim`` refuses a new transfer into any of them. A caller
that freed and handed out blocks before the old transfer settled (a bug: a late write of the
old sender could land in them) is refused at ``expect`` instead of having its KV overwritten.

A receive that cannot be cancelled (half-way in) holds its transfer's ``settled`` until it ends;
``expire`` gives such a hold up after the transport's ``fence_timeout_s`` (its sender may be dead,
which UCX does not report) and counts it, and counts a write that lands after that.
"""

from __future__ import annotations

import threading

from pdserve.transfer.pool_copy import PoolDestination
from pdserve.transfer.recv_transfer import RecvTransfer
from pdserve.transfer.stats import TransportCounters


class BlockFence:
    """One per receiving transport; ``claim`` and ``counters`` are safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[tuple[int, int], RecvTransfer] = {}  # (pool, block id) -> transfer
        self._claimed: dict[int, RecvTransfer] = {}  # id(transfer) -> transfer, until settled
        self.stale_messages = 0  # counted on the transport's thread
        self.fences_expired = 0
        self.late_writes = 0

    def claim(self, transfer: RecvTransfer) -> None:
        """Make ``transfer`` the owner of its destination's blocks until it settles; ValueError
        if one of them still belongs to a transfer that has not settled."""
        keys = _keys(transfer)
        with self._lock:
            for key in keys:
                owner = self._owner.get(key)
                if owner is not None:
                    state = "still receiving" if not owner.over else "a write may still land"
                    raise ValueError(
                        f"transfer {transfer.transfer_id}: block {key[1]} still belongs to "
                        f"transfer {owner.transfer_id} ({state}); free blocks only once their "
                        "transfer has settled (RecvTransfer.settled)"
                    )
            for key in keys:
                self._owner[key] = transfer
            self._claimed[id(transfer)] = transfer
        transfer.settled.add_done_callback(lambda _: self.release(transfer))

    def release(self, transfer: RecvTransfer) -> None:
        """``transfer``'s blocks are free of it (it settled, or it never started)."""
        with self._lock:
            if self._claimed.pop(id(transfer), None) is None:
                return
            for key in _keys(transfer):
                if self._owner.get(key) is transfer:
                    del self._owner[key]

    def count_stale(self, messages: int = 1) -> None:
        self.stale_messages += messages

    def expire(self, transfer: RecvTransfer) -> None:
        """On the transport's thread, ``fence_timeout_s`` after ``transfer`` failed: if a receive
        into its blocks is still under way, give up on it (its sender is taken for dead) and
        count it, and count every such receive that completes later (a write into blocks that
        may belong to someone else by then)."""
        if transfer.expire_settle(self._count_late_write):
            self.fences_expired += 1

    def _count_late_write(self) -> None:
        self.late_writes += 1

    def counters(self) -> TransportCounters:
        with self._lock:
            claimed = list(self._claimed.values())
        unsettled = [t for t in claimed if t.unsettled]
        return TransportCounters(
            stale_messages=self.stale_messages,
            unsettled_transfers=len(unsettled),
            unsettled_blocks=sum(t.num_blocks for t in unsettled),
            fences_expired=self.fences_expired,
            late_writes=self.late_writes,
        )


def _keys(transfer: RecvTransfer) -> list[tuple[int, int]]:
    dest = transfer.destination
    if not isinstance(dest, PoolDestination) or not dest.k_pools:
        return []
    pool = dest.k_pools[0].data_ptr()
    return [(pool, int(b)) for b in dest.block_ids.tolist()]
