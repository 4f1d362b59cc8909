"""What a transfer can fail with. Every error is a TransferError: the receiver frees the blocks it
reserved, the sender gives up on the transfer (and reconnects after PeerUnreachableError)."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer, or one send of it, did not complete by its deadline."""


class PeerUnreachableError(TransferError):
    """The peer is gone or cannot be reached; connect again, or pick another worker."""


class HeaderMismatchError(TransferError, ValueError):
    """A message or peer does not match this worker's protocol version or KV layout."""
