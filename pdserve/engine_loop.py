"""EngineLoop: the engine runs in its own thread; asyncio code talks to it through commands.

The gRPC server's event loop must stay free to answer health checks and admit requests while a
forward pass runs, so the model never runs on it. Everything that touches the engine — adding,
reserving, aborting — is a command executed by the engine thread between two steps; a request's
outputs come back on an ``asyncio.Queue`` of its own.

    event loop                         engine thread
    await loop.call(fn)   ---cmd--->   fn(engine)  (between steps)
    await queue.get()     <--outs---   engine.step()  ->  outputs per request
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pdserve.engine import LLMEngine
from pdserve.outputs import RequestOutput

T = TypeVar("T")


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        step_seconds: Callable[[float], None] | None = None,
    ) -> None:
        """``step_seconds(s)`` is told how long each step took (a metric)."""
        self.engine = engine
        self._step_seconds = step_seconds
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between steps; its result or exception comes back."""
        assert self._loop is not None, "EngineLoop.start() first"
        fut: asyncio.Future[T] = self._loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed back to the awaiting coroutine
                self._loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(command)
        return await fut

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """Outputs of ``request_id`` will be put here (call on the event loop, before adding it)."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _run(self) -> None:
        # Tensors made in a step are inference tensors; hooks that run after it (and buffers that
        # the transport reuses across steps) must be in inference mode too.
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while True:
            # Block for work only when the engine has none; otherwise drain commands and step.
            block = not self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = _NOTHING
            while command is not _NOTHING:
                if command is None:
                    return
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = _NOTHING
            if not self.engine.has_unfinished_requests():
                continue
            started = time.perf_counter()
            outputs = self.engine.step()
            if self._step_seconds is not None:
                self._step_seconds(time.perf_counter() - started)
            self.num_steps += 1
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)


def _NOTHING() -> None:  # sentinel: "no command this time"
    return None


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
