"""The receiver's side of one transfer: ``RecvTransfer``, returned by ``KVTransport.expect``.

Each message of a transfer is checked, accounted and landed in the transfer's destination here,
the same way for every transport; the transports only move bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import torch

from pdserve.transfer.errors import HeaderMismatchError, TransferError, TransferTimeoutError
from pdserve.transfer.header import (
    KVLayout,
    LayerHeader,
    check_transfer_id,
    message_views,
    read_header,
)
from pdserve.transfer.pool_copy import KVDestination, layer_callback
from pdserve.transfer.stats import WAIT_GRACE_S, TransferStats


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class TransferLoop(Protocol):
    """Where a transport runs transfer state: an asyncio loop, or the UCX worker thread.
    ``call_at`` takes time.monotonic() times (asyncio's ``loop.time()`` is that clock)."""

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Cancellable: ...

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any: ...


class RecvTransfer:
    """Receiver-side handle of one transfer, returned by ``KVTransport.expect``.

    State changes only on the transport's thread; ``wait``, ``done``, ``cancel`` and ``await``
    are safe from any thread or event loop. ``future`` ends when the transfer is over (completed,
    or failed: at once); ``settled`` when nothing can land in the destination any more, which is
    when its blocks may be freed: before ``future`` unless a message was half-way in (fence.py).
    """

    def __init__(
        self,
        layout: KVLayout,
        transfer_id: int,
        destination: KVDestination,
        timeout: float,
        loop: TransferLoop,
    ) -> None:
        check_transfer_id(transfer_id)
        num_blocks = destination.num_blocks
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.transfer_id = transfer_id
        self.num_blocks = num_blocks
        self.num_layers = layout.num_layers
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.future: concurrent.futures.Future[TransferStats] = concurrent.futures.Future()
        self.token_id = -1
        self.traceparent = ""  # of the sender's span, from the first message's header
        self.destination = destination
        self._on_layer = layer_callback(destination)
        self._loop = loop
        self._blocks_landed = [0] * self.num_layers
        self._full_nbytes = layout.message_nbytes(num_blocks)
        self._layers_complete = 0
        self._num_messages = 0
        self._nbytes = 0
        self._started = time.perf_counter()
        self._finish_callbacks: list[Callable[[RecvTransfer], None]] = []
        self._timer: Cancellable | None = None
        self.over = False  # completed or failed
        self.error: BaseException | None = None
        # done once nothing can land in the destination any more: every receive into it has
        # completed or been cancelled (the blocks may be freed then, not before; see ``settled``)
        self.settled: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._in_flight = 0  # receives into the destination that could not be cancelled
        self.expired = False  # settled by expire_settle with receives still under way
        self.on_late_write: Callable[[], None] | None = None

    # -- any thread ---------------------------------------------------------------------------

    def wait(self) -> TransferStats:
        """Block until every layer has landed; raise TransferError (or a subclass) otherwise.

        Returns by the transfer's deadline at the latest."""
        remaining = self.deadline - time.monotonic() + WAIT_GRACE_S
        try:
            return self.future.result(timeout=max(remaining, 0.0))
        except concurrent.futures.TimeoutError:
            raise self._timeout_error() from None

    def __await__(self) -> Generator[Any, None, TransferStats]:
        return asyncio.wrap_future(self.future).__await__()

    def done(self) -> bool:
        return self.future.done()

    @property
    def layers_received(self) -> int:
        return self._layers_complete

    def cancel(self, reason: str = "cancelled by the receiver") -> None:
        """Give up on the transfer (e.g. the client went away); ``wait`` raises TransferError."""
        err = TransferError(f"transfer {self.transfer_id}: {reason}")
        self._loop.call_soon_threadsafe(self.fail, err)

    # -- transport thread ---------------------------------------------------------------------

    def start(self, on_finish: Callable[[RecvTransfer], None]) -> None:
        """Arm the deadline; ``on_finish`` runs once, when the transfer completes or fails."""
        self._finish_callbacks.append(on_finish)
        self._timer = self._loop.call_at(self.deadline, self._on_deadline)

    def hold_settle(self) -> None:
        """A receive into the destination could not be cancelled (its data is on the way: a
        direct transfer's matched receive, ucx_direct_recv.py): ``settled`` waits for it. Called
        from an ``on_finish`` callback; ``release_settle`` when the receive has completed."""
        self._in_flight += 1

    def release_settle(self) -> None:
        self._in_flight -= 1
        if self.expired and self.on_late_write is not None:
            self.on_late_write()  # landed after the blocks were given up: a fence violation
        if self._in_flight == 0 and self.over and not self.settled.done():
            self.settled.set_result(None)

    def expire_settle(self, on_late_write: Callable[[], None]) -> bool:
        """Give up waiting for the receives still under way (their sender may be dead: UCX does
        not say): settle now. Each of them that completes later calls ``on_late_write``."""
        if not self.unsettled:
            return False
        self.expired, self.on_late_write = True, on_late_write
        self.settled.set_result(None)
        return True

    @property
    def unsettled(self) -> bool:
        """Over, but a receive into the destination is still under way (``hold_settle``) and
        has not been given up (``expire_settle``)."""
        return self.over and self._in_flight > 0 and not self.settled.done()

    def layer_complete(self, layer: int) -> bool:
        return self._blocks_landed[layer] >= self.num_blocks

    def deliver(
        self,
        buf: torch.Tensor,
        expected_layer: int | None = None,
        full_views: tuple[torch.Tensor, torch.Tensor] | None = None,
        head: memoryview | None = None,
        nbytes: int | None = None,
    ) -> LayerHeader | None:
        """Check one received message in ``buf`` and land its K and V in the destination.
        Made beforehand, once per buffer, to spare the work per message: ``full_views``, K and V
        of ``buf`` for a message of all ``num_blocks`` blocks (used when it is one); ``head``,
        its header bytes (``header_view``); ``nbytes``, what to count for the message if not
        its framed size.

        Fails the transfer (and returns None) on any mismatch or callback error."""
        if self.over:
            return None
        try:
            header = read_header(buf) if head is None else LayerHeader.unpack(head)
            header.check(self.layout)
            self._check(header, expected_layer)
            if full_views is not None and header.num_blocks == self.num_blocks:
                k, v = full_views
            else:
                k, v = message_views(buf, header)
        except HeaderMismatchError as exc:
            self.fail(exc)
            return None
        try:
            self._on_layer(header, k, v)
        except Exception as exc:  # noqa: BLE001 - the transfer fails with the cause attached
            err = TransferError(f"transfer {self.transfer_id}: landing failed: {exc!r}")
            err.__cause__ = exc
            self.fail(err)
            return None
        if nbytes is None:
            nbytes = (
                self._full_nbytes
                if header.num_blocks == self.num_blocks
                else self.layout.message_nbytes(header.num_blocks)
            )
        return self.landed(header, nbytes, messages=1)

    def landed(self, header: LayerHeader, nbytes: int, messages: int) -> LayerHeader | None:
        """Account for blocks of one layer that are in place (``deliver``, after landing them;
        a direct transfer, after they landed in the pools): ``nbytes`` in ``messages``."""
        if self.over:
            return None
        self._num_messages += messages
        self._nbytes += nbytes
        if header.token_id >= 0:
            self.token_id = header.token_id
        if header.traceparent and not self.traceparent:
            self.traceparent = header.traceparent
        self._blocks_landed[header.layer] += header.num_blocks
        if self._blocks_landed[header.layer] == self.num_blocks:
            self._layers_complete += 1
            if self._layers_complete == self.num_layers:
                stats = TransferStats(
                    self.transfer_id,
                    self.num_layers,
                    self._num_messages,
                    self._nbytes,
                    time.perf_counter() - self._started,
                )
                self._finish(stats, None)
        return header

    def _check(self, header: LayerHeader, expected_layer: int | None) -> None:
        def where() -> str:  # made only for an error: this runs once per message
            return f"transfer {self.transfer_id} layer {header.layer}"

        if header.transfer_id != self.transfer_id:
            raise HeaderMismatchError(
                f"{where()}: message belongs to transfer {header.transfer_id}"
            )
        if expected_layer is not None and header.layer != expected_layer:
            raise HeaderMismatchError(f"{where()}: arrived under the tag of layer {expected_layer}")
        end = header.block_offset + header.num_blocks
        if header.num_blocks < 1 or end > self.num_blocks:
            raise HeaderMismatchError(
                f"{where()}: blocks [{header.block_offset}, {end}) outside the {self.num_blocks} "
                "blocks reserved for this transfer"
            )
        if self._blocks_landed[header.layer] + header.num_blocks > self.num_blocks:
            raise HeaderMismatchError(f"{where()}: more blocks than reserved (duplicate message?)")

    def fail(self, exc: BaseException) -> None:
        if not self.over:
            self._finish(None, exc)

    def _on_deadline(self) -> None:
        self.fail(self._timeout_error())

    def _timeout_error(self) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"transfer {self.transfer_id}: {self._layers_complete}/{self.num_layers} layers arrived "
            f"within its {self.timeout:g} s deadline; the sender may be gone. Free its blocks."
        )

    def _finish(self, stats: TransferStats | None, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.over, self.error = True, exc
        for fn in self._finish_callbacks:  # they cancel the receives, and may hold_settle()
            fn(self)
        if self._in_flight == 0 and not self.settled.done():  # before the future: its
            self.settled.set_result(None)  # waiters may free the blocks at once
        if exc is None:
            self.future.set_result(stats)  # type: ignore[arg-type]
        else:
            self.future.set_exception(exc)
