"""The thread that owns a UCX worker: the plumbing under ucx.py.

One thread ("pdserve-ucx") does all UCX work for a transport: it posts every request, progresses
the worker (UCX moves the data inside ``progress``, e.g. the CMA copy of a message), notices
completed requests and runs their callbacks, runs timers (deadlines), and runs calls handed over
by other threads through a queue. When there is nothing to do it sleeps on the worker's epoll fd
(UCX wake-up events) and a wake-up pipe, so an idle transport costs no CPU.

Why not ucxx's asyncio API: measured on this 2-core host, a 30-message transfer reached 2.6-4 GB/s
through it (progress thread + notifier thread + event loop, several thread hops per message) and
4.5 GB/s with this one thread; and without its "python future" mode ``await req.wait()`` spins
the event loop (1.8 s CPU per second with 30 receives pending). Its module-level API is also one
process-global context whose notifier thread is not a daemon (a process hangs at exit unless
``ucxx.stop_notifier_thread()`` was called). So this uses ``ucxx.libucxx`` directly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import heapq
import itertools
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.transfer.errors import TransferError
from pdserve.transfer.ucx_buffers import ucx_array

QUARANTINE_S = 10.0  # how long a cancelled request's buffer is kept, in case UCX still writes it
MAX_SLEEP_S = 1.0
# On a CUDA transport, the longest sleep while requests are in flight. UCX's CUDA transports do
# not all wake a worker's epoll fd when their copies finish (cuda_copy gained an event fd only in
# UCX 1.9; UCX-Py saw CUDA transfers stall in blocking mode, rapidsai/ucx-py#888), and a
# rendezvous of CUDA memory takes several progress steps: each one must not wait for a timeout.
CUDA_IN_FLIGHT_SLEEP_S = 0.0005


def sleep_limit(cuda: bool, in_flight: bool, next_timer: float | None) -> float:
    """How long the worker thread may sleep on its fds: ``next_timer`` is the seconds to the
    earliest timer, if any."""
    limit = CUDA_IN_FLIGHT_SLEEP_S if cuda and in_flight else MAX_SLEEP_S
    return limit if next_timer is None else min(max(next_timer, 0.0), limit)


Completion = Callable[[BaseException | None], None]


class Timer:
    __slots__ = ("when", "seq", "fn", "args", "cancelled")

    def __init__(
        self, when: float, seq: int, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        self.when, self.seq, self.fn, self.args, self.cancelled = when, seq, fn, args, False

    def __lt__(self, other: Timer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)

    def cancel(self) -> None:
        self.cancelled = True


class UCXWorkerThread:
    def __init__(self, options: dict[str, str], device: torch.device) -> None:
        from ucxx import libucxx  # ucxx sets its UCX_* defaults when first imported

        self.ucx = libucxx
        self.TAG_MASK_FULL = libucxx.UCXXTagMaskFull
        self.device = device
        self._calls: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._lock = threading.Lock()
        self._sleeping = False
        self._stopping = False
        self._timers: list[Timer] = []
        self._seq = itertools.count()
        self._watched: list[tuple[Any, Completion]] = []
        self._forgotten: set[int] = set()  # ids of requests forgotten while _reap runs callbacks
        self.retiring = 0  # receives retired while matched: their data may still land (retire)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(options, started), name="pdserve-ucx"
        )
        self._thread.daemon = True
        self._thread.start()
        try:
            started.result()  # re-raises a failed UCX start-up here
        except BaseException:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    # -- any thread ---------------------------------------------------------------------------

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:  # held while waking too: stop() closes the pipe under it
            if self._stopping:
                raise RuntimeError("the UCX worker thread has stopped")
            self._calls.append((fn, args))
            if self._sleeping:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # the pipe is full of wake-ups already
                    pass

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """Run ``fn(*args)`` on the worker thread; return its result or raise its exception."""
        if self.in_thread():
            return fn(*args)
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result.set_exception(exc)

        self.call_soon_threadsafe(run)
        return result.result(timeout)

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; requests still posted are cancelled by UCX at teardown."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        os.write(self._wake_w, b"x")
        if self.in_thread():
            return  # the wake-up pipe stays open: closing it here could race a writer
        self._thread.join(timeout)
        if not self._thread.is_alive():
            with self._lock:  # no caller is between its _stopping check and its wake-up write
                os.close(self._wake_r)
                os.close(self._wake_w)

    # -- worker thread ------------------------------------------------------------------------

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """``when`` on the time.monotonic() clock (as asyncio's loop.time())."""
        timer = Timer(when, next(self._seq), fn, args)
        heapq.heappush(self._timers, timer)
        return timer

    def watch(self, request: Any, on_done: Completion) -> None:
        """Call ``on_done(None)`` or ``on_done(error)`` once ``request`` completes."""
        self._watched.append((request, on_done))

    def forget(self, request: Any, *keep_alive: Any) -> None:
        """Stop watching ``request`` and cancel it (ucxx cancels a request when it is dropped);
        its buffers stay referenced for QUARANTINE_S in case UCX is still using them."""
        self._watched = [(r, cb) for r, cb in self._watched if r is not request]
        self._forgotten.add(id(request))
        self.call_at(time.monotonic() + QUARANTINE_S, _noop, keep_alive)

    def retire(
        self, request: Any, *keep_alive: Any, on_over: Callable[[], None] | None = None
    ) -> bool:
        """Cancel the receive ``request`` and stop reporting it; whether it is over now. One that
        UCX has matched cannot be cancelled (``cancel``): it stays watched, its buffers
        (``keep_alive``) referenced, until it completes, and then ``on_over()`` runs. Nothing is
        freed on a timer: a sender stopped in the middle of a message may resume any time."""
        if _request_cancel() is None:  # another ucxx build: the old way, a quarantine
            self.forget(request, *keep_alive)
            return True
        self._watched = [(r, cb) for r, cb in self._watched if r is not request]
        self._forgotten.add(id(request))
        if self.cancel(request):
            return True
        self.retiring += 1
        held = [keep_alive]

        def over(_: BaseException | None) -> None:
            self.retiring -= 1
            held.clear()  # the buffers may go now
            if on_over is not None:
                on_over()

        self._watched.append((request, over))
        return False

    def cancel(self, request: Any) -> bool:
        """Cancel ``request`` and say whether it is over now. A receive that UCX has not matched
        yet completes at once (UCXXCanceledError, reported to its ``watch`` callback); one that is
        matched cannot be cancelled: its data is still on the way (a rendezvous in progress, whose
        sender may be stopped) and it completes when the data has landed. Without ucxx's
        ``RequestTag::cancel`` (another ucxx build) it is forgotten instead (dropping it cancels
        it too, unobserved) and reported as over."""
        fn = _request_cancel()
        if fn is None:
            self.forget(request)
            return True
        fn(request.ucxx_ptr)
        return bool(request.completed)

    def array(self, buf: torch.Tensor) -> Any:
        """A ucxx view of ``buf``'s memory (no copy): numpy on CPU, CUDA array interface on GPU."""
        return ucx_array(buf if buf.is_cuda else buf.numpy())

    def tag(self, value: int) -> Any:
        return self.ucx.UCXXTag(value)

    def tag_mask(self, value: int | None) -> Any:
        return self.ucx.UCXXTagMaskFull if value is None else self.ucx.UCXXTagMask(value)

    def _run(self, options: dict[str, str], started: concurrent.futures.Future[None]) -> None:
        ucx = self.ucx
        try:
            if self.device.type == "cuda":
                from ucxx._cuda_context import ensure_cuda_context

                ensure_cuda_context(self.device.index or 0)
            self.context = ucx.UCXContext(
                options, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
            )
            self.worker = ucx.UCXWorker(self.context)
            self.worker.init_blocking_progress_mode()
            poller = select.epoll()
            poller.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
            poller.register(self._wake_r, select.EPOLLIN)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the constructor
            started.set_exception(exc)
            return
        started.set_result(None)
        try:
            while not self._stopping:
                self._step(poller)
        finally:
            self._watched.clear()
            self._timers.clear()
            poller.close()

    def _step(self, poller: select.epoll) -> None:
        busy = self._run_calls()
        while self.worker.progress_once():
            busy = True
        busy = self._reap() or busy
        busy = self._run_timers() or busy
        if busy:
            return
        with self._lock:
            if self._calls or self._stopping:
                return
            self._sleeping = True
        events: list[tuple[int, int]] = []
        try:
            if self.worker.arm():  # no UCX events pending: sleep until one, or a call, or a timer
                timer = self._timers[0].when - time.monotonic() if self._timers else None
                timeout = sleep_limit(self.device.type == "cuda", bool(self._watched), timer)
                events = poller.poll(timeout)
        finally:
            with self._lock:
                self._sleeping = False
        if any(fd == self._wake_r for fd, _ in events):  # else leave it: it stays readable
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

    def _run_calls(self) -> bool:
        if not self._calls:  # most steps (a call appended meanwhile is seen before sleeping)
            return False
        with self._lock:
            calls, self._calls = self._calls, collections.deque()
        for fn, args in calls:
            fn(*args)
        return bool(calls)

    def _reap(self) -> bool:
        # Requests complete only inside progress, on this thread: one pass sees a stable state.
        done, waiting = [], []
        for entry in self._watched:
            (done if entry[0].completed else waiting).append(entry)
        if not done:
            return False
        self._watched = waiting
        self._forgotten.clear()
        for request, on_done in done:
            if self._forgotten and id(request) in self._forgotten:
                continue  # forgotten by an earlier callback of this pass: not ours to report
            try:
                request.check_error()
            except Exception as exc:  # noqa: BLE001 - the UCX status, handed to the callback
                on_done(exc)
            else:
                on_done(None)
        return True

    def _run_timers(self) -> bool:
        if not self._timers:
            return False
        now = time.monotonic()
        ran = False
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.fn(*timer.args)
                ran = True
        return ran


def call_or_closed(ucx: UCXWorkerThread, fn: Callable[..., Any], *args: Any) -> Any:
    """``ucx.call``, raising TransferError("transport closed") once the thread has stopped."""
    try:
        return ucx.call(fn, *args)
    except RuntimeError as exc:
        if not ucx.running:
            raise TransferError("transport closed") from exc
        raise


def call_soon_or_closed(ucx: UCXWorkerThread, fn: Callable[..., Any], *args: Any) -> None:
    """``ucx.call_soon_threadsafe``, raising TransferError("transport closed") once stopped."""
    try:
        ucx.call_soon_threadsafe(fn, *args)
    except RuntimeError as exc:
        raise TransferError("transport closed") from exc


def _noop(*_: Any) -> None:
    pass


@functools.cache
def _request_cancel() -> Any:
    """``ucxx::RequestTag::cancel()`` (a tag request's override of ``Request::cancel``) of the
    loaded libucxx, which ucxx's Python API does not expose (it cancels a request only in its
    destructor, i.e. when the request is dropped, unobserved). ``UCXRequest.ucxx_ptr`` is the
    request object's address; ``RequestTag`` derives from ``Request`` alone."""
    try:
        import libucxx

        path = os.path.join(os.path.dirname(libucxx.__file__), "lib64", "libucxx.so")
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        fn = lib._ZN4ucxx10RequestTag6cancelEv
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p], None
    return fn
