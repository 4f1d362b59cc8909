"""One transfer as each side sees it: ``RecvTransfer`` (decode) and ``SendTransfer`` (prefill).

Each message of a transfer is checked, accounted and handed on here, the same way for every
transport; the transports only move bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.transfer.errors import (
    HeaderMismatchError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.transfer.header import (
    HEADER_NBYTES,
    KVLayout,
    LayerHeader,
    check_transfer_id,
    message_views,
    read_header,
)

if TYPE_CHECKING:
    from pdserve.transfer.base import KVTransport


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """Where a transport runs transfer state: an asyncio loop, or the UCX worker thread.
    ``call_at`` takes time.monotonic() times (asyncio's ``loop.time()`` is that clock)."""

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Cancellable: ...

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any: ...


LayerCallback = Callable[[LayerHeader, torch.Tensor, torch.Tensor], None]
_FRAMED = "framed"


class DirectPlan:
    """A transport's plan for sending one transfer straight from pools (``plan_direct``)."""

    plan_nbytes: int  # the plan message
    layer_nbytes: int  # K and V of one layer, in all its data messages


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


@dataclass(eq=False)
class PeerHandle:
    """A sender's connection to one receiver, from ``connect``; implementations subclass it."""

    address: bytes
    alive: bool = True


class RecvTransfer:
    """Receiver-side handle of one transfer, returned by ``KVTransport.expect``.

    State changes only on the transport's thread; ``wait``, ``done``, ``cancel`` and ``await``
    are safe from any thread or event loop.
    """

    def __init__(
        self,
        layout: KVLayout,
        transfer_id: int,
        num_blocks: int,
        on_layer: LayerCallback,
        timeout: float,
        scheduler: Scheduler,
    ) -> None:
        check_transfer_id(transfer_id)
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
        self.on_layer = on_layer
        self._scheduler = scheduler
        self._blocks_landed = [0] * self.num_layers
        self._full_nbytes = layout.message_nbytes(num_blocks)
        self._layers_complete = 0
        self._num_messages = 0
        self._nbytes = 0
        self._started = time.perf_counter()
        self._finish_callbacks: list[Callable[[RecvTransfer], None]] = []
        self._timer: Cancellable | None = None
        self.over = False  # completed or failed (the future may follow later: hold_failure)
        self.error: BaseException | None = None
        self._hold_s = 0.0

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
        self._scheduler.call_soon_threadsafe(self.fail, err)

    # -- transport thread ---------------------------------------------------------------------

    def start(self, on_finish: Callable[[RecvTransfer], None]) -> None:
        """Arm the deadline; ``on_finish`` runs once, when the transfer completes or fails."""
        self._finish_callbacks.append(on_finish)
        self._timer = self._scheduler.call_at(self.deadline, self._on_deadline)

    def hold_failure(self, seconds: float) -> None:
        """From an ``on_finish`` callback of a failing transfer: fail the future (on which the
        caller frees the blocks) only ``seconds`` later, for writes into the blocks that the
        transport could not cancel (a direct transfer's matched receives, ucx_direct.py)."""
        self._hold_s = max(self._hold_s, seconds)

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
        """Check one received message in ``buf`` and hand its K and V to ``on_layer``.
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
            self.on_layer(header, k, v)
        except Exception as exc:  # noqa: BLE001 - the transfer fails with the cause attached
            err = TransferError(f"transfer {self.transfer_id}: on_layer failed: {exc!r}")
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
        """Account for blocks of one layer that are in place (``deliver``, after ``on_layer``;
        a direct transfer, after they landed in the pool): ``nbytes`` in ``messages``."""
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
        if exc is None:
            self.future.set_result(stats)  # type: ignore[arg-type]
        for fn in self._finish_callbacks:  # on failure they may hold_failure()
            fn(self)
        if exc is not None:
            if self._hold_s > 0:
                self._scheduler.call_at(
                    time.monotonic() + self._hold_s, self.future.set_exception, exc
                )
            else:
                self.future.set_exception(exc)


class SendTransfer:
    """Sender-side view of one transfer: builds headers, tracks sends, sums up stats.

    Used from one thread (the engine's); created by ``KVTransport.start_send``."""

    def __init__(
        self,
        transport: KVTransport,
        peer: PeerHandle,
        transfer_id: int,
        num_blocks: int,
        timeout: float,
        traceparent: str = "",
        device: str | torch.device = "cpu",
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        check_transfer_id(transfer_id)
        if dst_block_ids is not None and len(dst_block_ids) != num_blocks:
            raise ValueError(f"{len(dst_block_ids)} destination block ids for {num_blocks} blocks")
        self.dst_block_ids = None if dst_block_ids is None else [int(b) for b in dst_block_ids]
        self.device = torch.device(device)
        self.transport = transport
        self.peer = peer
        self.transfer_id = transfer_id
        self.num_blocks = num_blocks
        self.deadline = time.monotonic() + timeout
        self.traceparent = traceparent
        self._futures: list[concurrent.futures.Future[None]] = []
        self._nbytes = 0
        self._started: float | None = None
        self._finished = 0.0
        self._num_finished = 0
        self._lock = threading.Lock()
        self._plan: Any = None  # send_pool_layer's: the transport's direct plan, or _FRAMED
        self._held_last: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer_buffers(self, num_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V tensors to gather a layer into, sent without a copy (see KVTransport)."""
        return self.transport.layer_buffers(num_blocks or self.num_blocks, self.device)

    def send_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        block_offset: int = 0,
        token_id: int = -1,
    ) -> concurrent.futures.Future[None]:
        """Push one layer's gathered blocks; returns once they are copied out, before delivery."""
        remaining = self._remaining(layer)
        if isinstance(self._plan, DirectPlan):
            raise RuntimeError(f"transfer {self.transfer_id} is sent direct: use send_pool_layer")
        layout = self.transport.layout
        header = LayerHeader.for_layer(
            layout,
            self.transfer_id,
            layer,
            k.shape[0],
            block_offset=block_offset,
            token_id=token_id,
            traceparent=self.traceparent,
        )
        if self._started is None:
            self._started = time.perf_counter()
        fut = self.transport.send_layer(self.peer, header, k, v, timeout=remaining)
        self._track(fut, layout.message_nbytes(header.num_blocks))
        return fut

    def send_pool_layer(
        self, layer: int, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
    ) -> None:
        """Send layer ``layer`` of the pools' blocks ``block_ids`` (int64, the same for every
        layer); the last layer goes with ``finish``, which adds the first token.

        Straight from the pools (no copy; ``plan.py``) when the destination's block ids were
        given to ``start_send`` and the transport can, in which case the pools' blocks must stay
        unchanged until ``wait`` returns; else gathered into a message buffer first (a copy)."""
        if self._plan is None:
            self._plan = self._make_plan(k_pool, v_pool, block_ids)
        if isinstance(self._plan, DirectPlan):
            remaining = self._remaining(layer)
            futures = self.transport.send_direct(
                self.peer, self._plan, layer, k_pool, v_pool, remaining
            )
            for i, fut in enumerate(futures):  # the layer's bytes, counted once
                self._track(fut, self._plan.layer_nbytes if i == 0 else 0)
            return
        from pdserve.transfer.base import gather_into  # base imports this module

        k, v = self.layer_buffers()
        gather_into(k_pool, v_pool, block_ids, k, v)
        if layer == self.transport.layout.num_layers - 1:
            self._held_last = (k, v)
        else:
            self.send_layer(layer, k, v)

    @property
    def direct(self) -> bool:
        """Whether ``send_pool_layer`` sends straight from the pools (decided at its first call)."""
        return isinstance(self._plan, DirectPlan)

    def finish(self, token_id: int = -1) -> None:
        """Send what is left after the last ``send_pool_layer``, with the first sampled token:
        the trailer of a direct transfer, else the held last layer."""
        last = self.transport.layout.num_layers - 1
        if isinstance(self._plan, DirectPlan):
            header = LayerHeader.for_layer(
                self.transport.layout,
                self.transfer_id,
                last,
                self.num_blocks,
                token_id=token_id,
                traceparent=self.traceparent,
            )
            fut = self.transport.send_trailer(self.peer, header, self._remaining(last))
            self._track(fut, HEADER_NBYTES)
        elif self._held_last is not None:
            (k, v), self._held_last = self._held_last, None
            self.send_layer(last, k, v, token_id=token_id)
        else:
            raise RuntimeError(f"transfer {self.transfer_id}: finish before the last layer")

    def _make_plan(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
    ) -> Any:
        if self.dst_block_ids is None:
            return _FRAMED
        src = [int(b) for b in block_ids.tolist()]
        if len(src) != self.num_blocks:
            raise ValueError(f"{len(src)} block ids for a transfer of {self.num_blocks} blocks")
        if self._started is None:
            self._started = time.perf_counter()
        made = self.transport.plan_direct(self, k_pool, v_pool, src, self._remaining(0))
        if made is None:
            return _FRAMED
        plan, fut = made
        self._track(fut, plan.plan_nbytes)
        return plan

    def _remaining(self, layer: int) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeoutError(
                f"transfer {self.transfer_id}: deadline passed before layer {layer}"
            )
        return remaining

    def _track(self, fut: concurrent.futures.Future[None], nbytes: int) -> None:
        if self._started is None:
            self._started = time.perf_counter()
        self._nbytes += nbytes
        fut.add_done_callback(self._record_finish)
        self._futures.append(fut)

    def _record_finish(self, _: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._finished = max(self._finished, time.perf_counter())
            self._num_finished += 1

    def wait(self) -> TransferStats:
        """Block until every send has been taken by the receiver; raise the first failure."""
        for fut in self._futures:
            remaining = self.deadline - time.monotonic() + WAIT_GRACE_S
            try:
                fut.result(timeout=max(remaining, 0.0))
            except concurrent.futures.TimeoutError:
                raise TransferTimeoutError(
                    f"transfer {self.transfer_id}: sends not completed by the deadline"
                ) from None
        now = time.perf_counter()
        started = self._started if self._started is not None else now
        with self._lock:  # a future's waiters wake before its callbacks run: count those as now
            finished = self._finished if self._num_finished == len(self._futures) else now
        return TransferStats(
            self.transfer_id,
            self.transport.layout.num_layers,
            len(self._futures),
            self._nbytes,
            max(finished - started, 0.0),
        )
