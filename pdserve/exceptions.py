"""The exceptions that end an RPC with a status of their own (``services/errors.py``'s table).

Defined here, with no import of torch or the engine, so that the gateway, which names them in the
same table as the workers, starts without the engine's modules (no torch: ~1.7 s and ~200 MB of
its start). Their modules re-export them: ``pdserve.engine.AdmissionError``,
``pdserve.engine_loop.EngineDeadError``, ``pdserve.transfer``'s errors.
"""

from __future__ import annotations


class AdmissionError(RuntimeError):
    """The worker cannot take the request now (KV blocks or seats); another worker may."""


class EngineDeadError(RuntimeError):
    """The engine thread has ended (it raised, or the loop was stopped): this worker serves no
    more requests. UNAVAILABLE for the gateway, which tries another worker."""


# What a transfer can fail with. Every error is a TransferError: the receiver frees the blocks it
# reserved, the sender gives up on the transfer (and reconnects after PeerUnreachableError).


class TransferError(RuntimeError):
    """A transfer failed."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer, or one send of it, did not complete by its deadline."""


class PeerUnreachableError(TransferError):
    """The peer is gone or cannot be reached; connect again, or pick another worker."""


class HeaderMismatchError(TransferError, ValueError):
    """A message or peer does not match this worker's protocol version or KV layout."""
