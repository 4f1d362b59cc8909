"""An asyncio event loop running in its own daemon thread, with a thread-safe submit API.

Transports own one each: the engine thread (which computes layers) and the services' grpc.aio loop
both talk to a transport from their own threads, and neither may be blocked by transfer progress.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; callable from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = 30.0) -> T:
        """Run ``fn(*args)`` on the loop thread and return its result (from another thread)."""
        if self.in_loop():
            return fn(*args)
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return result.result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_loop():
            self._thread.join(timeout)
