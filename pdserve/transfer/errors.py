"""What a transfer can fail with (defined in ``pdserve.exceptions``, which the gateway imports
without the transfer package). Every error is a TransferError: the receiver frees the blocks it
reserved, the sender gives up on the transfer (and reconnects after PeerUnreachableError)."""

from __future__ import annotations

from pdserve.exceptions import (
    HeaderMismatchError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)

__all__ = ["HeaderMismatchError", "PeerUnreachableError", "TransferError", "TransferTimeoutError"]
