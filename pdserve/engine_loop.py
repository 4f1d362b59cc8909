"""EngineLoop: the engine runs in its own thread; asyncio code talks to it through commands.

The gRPC server's event loop must stay free to answer health checks and admit requests while a
forward pass runs, so the model never runs on it. Everything that touches the engine — adding,
reserving, aborting — is a command executed by the engine thread between two steps; a request's
outputs come back on an ``asyncio.Queue`` of its own.

    event loop                         engine thread
    await loop.call(fn)   ---cmd--->   fn(engine)  (between steps)
    await queue.get()     <--outs---   engine.step()  ->  outputs per request

Liveness: the thread stamps the time each time it wakes for work (a command, or a step), and
clears the stamp while it waits idle; ``busy_for()`` is how long the current piece of work has
run. A worker whose engine is ``alive`` but busy for longer than its stall bound is reported
unhealthy (services/main.py). ``progress()`` adds the steps completed and how long the current
step should take (pdserve/step_cost.py, learned from this worker's own steps): the Stats RPC
reports it, and the gateway evicts a worker whose step runs far past it (gateway/watchdog.py).
If the thread dies (``engine.step`` raised), every open stream and every pending or later
``call`` fails with ``EngineDeadError``: nothing waits for it forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pdserve import kernels, telemetry
from pdserve.engine import LLMEngine
from pdserve.exceptions import EngineDeadError
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.step_cost import EngineProgress, StepCost

T = TypeVar("T")
WARM_UP_TOKENS = 64  # prompt tokens of each warm-up generation
LAYER_MARKS_S = 0.25  # steps predicted at least this long mark each layer done (progress())


class OutputQueue(asyncio.Queue):
    """A request's outputs; ``get`` raises EngineDeadError once the engine thread has died."""

    async def get(self) -> RequestOutput:
        item = await super().get()
        if isinstance(item, BaseException):
            raise item
        return item


class _Command:
    __slots__ = ("fn", "fail")

    def __init__(self, fn: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        self.fn = fn
        self.fail = fail


# What a stream interval of None (auto, the workers' default) stands for when the engine's steps
# fill every core the worker may run on. Each message a request's tokens go on in costs its hops
# CPU (worker event loop, gateway, client: ~1.4 ms a token on a 2-core Zen 4, three quarters of it
# in grpc.aio's own machinery), which then preempts one of the step's threads and makes the other
# wait at the next barrier; at 25 ms a one-user stream's ~4.4 ms steps send ~5 tokens a message.
# A step slower than this sends every token at once anyway (docs/benchmarks.md).
AUTO_STREAM_INTERVAL_S = 0.025


def auto_stream_interval(device: torch.device, threads: int, cores: int) -> float:
    """The stream interval (seconds) auto stands for: AUTO_STREAM_INTERVAL_S when a CPU engine's
    ``threads`` (its most: borrowed cores' included) leave none of the worker's ``cores`` free for
    the messages, else 0 (every token at once: on a free core, or beside a GPU's steps, the
    messages cost the steps nothing)."""
    if device.type != "cpu" or threads < cores:
        return 0.0
    return AUTO_STREAM_INTERVAL_S


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        step_seconds: Callable[[float], None] | None = None,
        warm_up: bool = True,
        borrow_cpus: frozenset[int] = frozenset(),
        may_borrow: Callable[[], bool] | None = None,
        stream_interval_s: float | None = 0.0,
    ) -> None:
        """``step_seconds(s)`` is told how long each step took (a metric); ``warm_up``: two
        short generations before serving (``_warm_up``); ``borrow_cpus``: cores beyond the
        engine thread's own whose time its steps also use while ``may_borrow()`` (engine thread,
        before each step) says that their owner is idle (``_borrow``); ``stream_interval_s``: a
        request's outputs are handed to its stream at most this often, those between merged
        (``_coalesce``; 0: each step's at once; None: ``auto_stream_interval``, decided when the
        engine thread starts)."""
        if stream_interval_s is not None and not stream_interval_s >= 0:
            raise ValueError(f"the stream interval must be >= 0 seconds, got {stream_interval_s}")
        self.stream_interval_s = stream_interval_s
        # engine thread: outputs held back, and when each request's were last handed on
        self._held: dict[str, RequestOutput] = {}
        self._handed_at: dict[str, float] = {}
        self.warm_up = warm_up
        self.borrow_cpus = frozenset(borrow_cpus)
        self._may_borrow = may_borrow
        # (threads on its own cores, with the borrowed ones) once the engine thread set them up
        self._threads: tuple[int, int] | None = None
        self.threads_now = 0  # OpenMP threads of the step running now (0: not set up)
        self.engine = engine
        self._step_seconds = step_seconds
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, OutputQueue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        # monotonic time the thread woke for its current work; None while it waits idle
        self._busy_since: float | None = None
        self.cost = StepCost()
        self._step_tokens = 0  # of the step running now (0: commands only, so far)
        self._step_predicted_s = 0.0
        # Steps predicted longer than LAYER_MARKS_S mark each layer done: progress() then
        # covers the time since the last mark against a layer's share of the prediction, so a
        # stuck engine shows within seconds however long its steps are.
        self._layer_at: float | None = None  # monotonic time of the last mark in this step
        self._layers = engine.model_config.num_layers
        engine.on_schedule = self._scheduled
        self._lock = threading.Lock()  # orders "dead" against commands being queued
        self.error: BaseException | None = None  # why the thread ended (None: stopped, or running)
        self._dead = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Warm up (``_warm_up``, in the caller's thread: the worker is not serving yet, and
        is done with it before it says it is), then start the engine thread. The caller's idle
        OpenMP threads (from loading and warming up) are released first: left behind, they made
        every decode step of the engine thread ~1.9x slower (kernels/cpu/openmp.py)."""
        if self.warm_up:
            with torch.inference_mode():
                self._warm_up()
        kernels.release_cpu_thread_pool()
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            with self._lock:
                if not self._dead:
                    self._commands.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        """The thread runs (started, not stopped, has not died)."""
        return self._thread is not None and self._thread.is_alive() and not self._dead

    def busy_for(self) -> float:
        """Seconds the thread has spent on its current command or step; 0 while it waits idle.
        A step takes milliseconds to a few seconds: much longer means it is stuck."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def progress(self) -> EngineProgress:
        """Steps done, and the current work's time so far and prediction (from any thread). In a
        step that marks its layers: the time since the last mark (or the step's start) and one
        layer's share of the step's prediction (the last share: norm, logits, sampling)."""
        predicted, layer_at = self._step_predicted_s, self._layer_at
        busy = self.busy_for()
        if layer_at is not None and busy > 0:
            busy = min(busy, time.monotonic() - layer_at)
            predicted /= self._layers + 1
        return EngineProgress(self.num_steps, busy, predicted)

    def _scheduled(self, num_tokens: int) -> Callable[[int], None] | None:
        """Engine thread, the batch of the step about to run is known: predict its time; a long
        step is to mark its layers (``_layer_done``)."""
        self._step_tokens = num_tokens
        self._step_predicted_s = predicted = self.cost.predict(num_tokens)
        if predicted < LAYER_MARKS_S:
            return None
        self._layer_at = time.monotonic()
        return self._layer_done

    def _layer_done(self, layer: int) -> None:
        self._layer_at = time.monotonic()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between steps; its result or exception comes
        back. EngineDeadError when the thread has died (or dies before it runs ``fn``)."""
        assert self._loop is not None, "EngineLoop.start() first"
        loop = self._loop
        fut: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed back to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        def fail(e: BaseException) -> None:
            loop.call_soon_threadsafe(_set_exception, fut, e)

        with self._lock:
            if self._dead:
                raise self._dead_error()
            self._commands.put(_Command(command, fail))
        return await fut

    async def cleanup(self, fn: Callable[[LLMEngine], Any]) -> None:
        """``call(fn)`` for freeing a request's state: moot, and skipped, once the thread has died
        (the engine's state went with it), so a request's clean-up never raises for that."""
        try:
            await self.call(fn)
        except EngineDeadError:
            pass

    def _dead_error(self) -> EngineDeadError:
        why = f": {type(self.error).__name__}: {self.error}" if self.error is not None else ""
        return EngineDeadError(f"the engine thread has ended{why}")

    def open_stream(self, request_id: str) -> OutputQueue:
        """Outputs of ``request_id`` will be put here (call on the event loop, before adding it).
        ValueError when a stream of that id is open: the request it belongs to keeps it (a second
        one took its outputs, and ended it with its own error, before)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use on this worker")
        q = OutputQueue()
        if self._dead:
            q.put_nowait(self._dead_error())
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_streams(self) -> None:
        for q in self._streams.values():
            q.put_nowait(self._dead_error())

    def _borrow(self) -> None:
        """Engine thread, before serving, with ``borrow_cpus``: a pool of OpenMP threads that
        may run on those cores too, while this thread keeps to its own.

        A prefill and a decode worker pinned to a core each (``pdserve up`` on 2 cores) leave
        each other's core idle much of the time: the prefill core whenever no prompt is being
        computed — at one user most of the time, and at the end of every burst — and the decode
        core while it has no stream. So each one's steps run with a thread on the other's core
        while the other is idle: a decode worker's while no KV is on its way to it (a prompt is
        queued or computing for it: the gateway reserves the blocks before it sends the prompt),
        a prefill worker's while each prompt it computes is for a decode worker that runs
        nothing else (the gateway says so in the request). Otherwise each keeps to its own
        core, so the two never share one for long. The pool's threads are made here with both
        sets of cores allowed (a thread keeps the affinity it was made with), then this thread
        returns to its own."""
        own = os.sched_getaffinity(0)
        extra = self.borrow_cpus - own
        n_own = torch.get_num_threads()
        self._threads = (n_own, n_own + len(extra))
        self.threads_now = n_own
        if not extra:
            return
        try:
            os.sched_setaffinity(0, own | extra)
        except OSError as e:  # not this process's to use (the CLI checks it first)
            telemetry.logger().warning("engine.borrow_refused", cpus=sorted(extra), error=str(e))
            self._threads = (n_own, n_own)
            return
        try:
            torch.set_num_threads(self._threads[1])
            x = torch.zeros(1 << 22)
            x.add_(1.0)  # a parallel region: the pool's threads are made now, on own | extra
        finally:
            os.sched_setaffinity(0, own)
            torch.set_num_threads(n_own)
        telemetry.logger().info(
            "engine.borrowing", own_cpus=sorted(own), borrowed_cpus=sorted(extra), threads=n_own
        )

    def _auto_stream_interval(self) -> None:
        """Engine thread, before serving: the stream interval auto stands for, with the threads
        the steps use at most and the cores the worker may run on (its own and borrowed)."""
        threads = self._threads[1] if self._threads else torch.get_num_threads()
        cores = len(os.sched_getaffinity(0) | self.borrow_cpus)
        device = self.engine.runner.device
        self.stream_interval_s = auto_stream_interval(device, threads, cores)
        telemetry.logger().info(
            "engine.stream_interval",
            ms=self.stream_interval_s * 1000,
            threads=threads,
            cores=cores,
            device=device.type,
        )

    def _threads_for_step(self) -> None:
        """Engine thread: the borrowed cores' threads join the next step if ``may_borrow()``."""
        if self._threads is None:
            return
        n = self._threads[1] if self._may_borrow() else self._threads[0]
        if n != self.threads_now:
            torch.set_num_threads(n)
            self.threads_now = n

    def _run(self) -> None:
        try:
            if self.borrow_cpus and self._may_borrow is not None:
                self._borrow()
            if self.stream_interval_s is None:
                self._auto_stream_interval()
            # Tensors made in a step are inference tensors; hooks that run after it (and buffers
            # that the transport reuses across steps) must be in inference mode too.
            with torch.inference_mode():
                self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread ends; its callers learn why
            self.error = e
            telemetry.logger().error("engine.died", exc_info=e)
        finally:
            self._busy_since = None
            with self._lock:
                self._dead = True
            # Nothing is queued after _dead is set: fail what was, and every open stream (unless
            # the event loop is closed already: then nobody waits).
            with contextlib.suppress(RuntimeError):
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if command is not None:
                        command.fail(self._dead_error())
                if self.error is not None:
                    self._loop.call_soon_threadsafe(self._fail_streams)

    def _warm_up(self) -> None:
        """Before serving: two short generations of made-up token ids, the second
        one timed. The first pays the one-off set-up (the layer loop compiled, memory touched)
        before any request does; the second gives ``cost`` measured steps, so the hang
        watchdog's bound holds from the first request on (pdserve/step_cost.py)."""
        engine = self.engine
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        for i in range(2):
            ids = [(1000 + 613 * i + k) % vocab for k in range(WARM_UP_TOKENS)]
            engine.add_request(ids, params, f"warm-up-{i}")
            while engine.has_unfinished_requests():
                _, seconds = self._timed_step()
                if i:
                    self.cost.observe(self._step_tokens, seconds)

    def _timed_step(self) -> tuple[list[RequestOutput], float]:
        """One engine step and the seconds it took."""
        started = time.perf_counter()
        outputs = self.engine.step()
        return outputs, time.perf_counter() - started

    def _serve(self) -> None:
        idle = False  # the last step found nothing to run: only a command can change that
        while True:
            # Block for work when the engine has none, or none it can run now (a request that
            # waits for a prefix being received: its KV lands by a command); else drain commands
            # and step.
            block = idle or not self.engine.has_unfinished_requests()
            self._step_tokens, self._step_predicted_s, self._layer_at = 0, 0.0, None
            if block:
                self._busy_since = None
                self._release_held()
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = _NOTHING
            self._busy_since = time.monotonic()
            while command is not _NOTHING:
                if command is None:
                    return
                command.fn()
                idle = False
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = _NOTHING
            if not self.engine.has_unfinished_requests():
                continue
            self._threads_for_step()
            outputs, seconds = self._timed_step()
            idle = self.engine.last_step is None
            if idle:
                continue
            self.cost.observe(self._step_tokens, seconds)
            if self._step_seconds is not None:
                self._step_seconds(seconds)
            self.num_steps += 1
            if self.stream_interval_s:
                outputs = self._coalesce(outputs, time.monotonic())
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _coalesce(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """Engine thread, ``stream_interval_s`` set: the outputs to hand on now. A request's
        output goes on at once when it is its first, its last, or ``stream_interval_s`` has
        passed since its previous one went; otherwise it is held and merged with the next (one
        message then carries several tokens). Each handed-on output costs the event loop a
        wake-up and a message through every hop to the client (worker, gateway, client: ~1 ms of
        CPU a token on a 2-core Zen 5, taken from the cores the step runs on), so at one user
        and fast steps this is what lets the step run at its offline speed. Held outputs whose
        time has come go on too, new output or not (a request that waits for a step)."""
        interval = self.stream_interval_s
        held, handed = self._held, self._handed_at
        ready = []
        for out in outputs:
            rid = out.request_id
            before = held.pop(rid, None)
            if before is not None:
                out = _merged(before, out)
            last = handed.get(rid)
            if out.finished:
                handed.pop(rid, None)
                ready.append(out)
            elif last is None or now - last >= interval:
                handed[rid] = now
                ready.append(out)
            else:
                held[rid] = out
        live = self.engine.requests_in_flight()
        for rid in [r for r in handed if r not in live]:  # ended elsewhere (aborted): forgotten
            handed.pop(rid)
            held.pop(rid, None)
        for rid in [r for r, out in held.items() if now - handed[r] >= interval]:
            handed[rid] = now
            ready.append(held.pop(rid))
        return ready

    def _release_held(self) -> None:
        """Engine thread, about to wait for work: nothing stays held while no step runs."""
        if self._held:
            outputs = list(self._held.values())
            self._held.clear()
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        self._handed_at.clear()


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``b``, a later output of the same request, with ``a``'s tokens (and text) before its own."""
    b.new_token_ids = a.new_token_ids + b.new_token_ids
    b.new_text = a.new_text + b.new_text
    b.new_logprobs = a.new_logprobs + b.new_logprobs
    return b


def _NOTHING() -> None:  # sentinel: "no command this time"
    return None


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
