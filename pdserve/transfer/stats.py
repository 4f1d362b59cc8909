"""What one transfer moved and how fast: ``TransferStats``, the result of either side's ``wait``."""

from __future__ import annotations

from dataclasses import dataclass

WAIT_GRACE_S = 1.0  # wait() gives up this long after the deadline even if the transport is stuck


@dataclass(frozen=True)
class TransferStats:
    """``seconds``: on the receiver, from ``expect`` to the last layer landed; on the sender,
    from the first ``send_layer`` to the last message taken by the receiver. Both include the
    time the prefill spends computing between layers when sends are pipelined with compute."""

    transfer_id: int
    num_layers: int
    num_messages: int
    nbytes: int  # payload and headers
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def attributes(self) -> dict[str, int | float]:
        """For a span: what moved, how fast."""
        return {
            "transfer_id": self.transfer_id,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "layers": self.num_layers,
            "messages": self.num_messages,
        }

    def __str__(self) -> str:
        return (
            f"transfer {self.transfer_id}: {self.nbytes} bytes in {self.seconds * 1e3:.2f} ms "
            f"({self.gbps:.2f} GB/s, {self.num_messages} messages)"
        )


@dataclass(frozen=True)
class TransportCounters:
    """What a receiving transport fenced off since it started (``KVTransport.counters``)."""

    stale_messages: int = 0  # messages of a transfer that was over, dropped without landing
    unsettled_transfers: int = 0  # over, but a receive into their blocks is still under way
    unsettled_blocks: int = 0  # the blocks of those: held, not free, until the receives end
    fences_expired: int = 0  # transfers settled by fence_timeout_s with a receive still under way
    late_writes: int = 0  # receives of those that completed later: wrote into freed blocks
