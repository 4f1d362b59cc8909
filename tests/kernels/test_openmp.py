"""kernels/cpu/openmp.py: a thread's idle OpenMP pool is ended, and a worker's engine loop ends
the pool its loading and warm-up left in the main thread before its engine thread steps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 CPU threads")

COUNT = """
import os, time, torch
from pdserve.kernels.cpu import openmp
def threads():
    return len(os.listdir("/proc/self/task"))
def threads_once_at_most(n, timeout=10.0):
    # a released pool's threads exit on their own (libgomp does not join them): their count is
    # polled until it is down to n, or the timeout has passed
    deadline = time.monotonic() + timeout
    while threads() > n and time.monotonic() < deadline:
        time.sleep(0.001)
    return threads()
def parallel_op():  # large enough that torch opens an OpenMP region
    x = torch.ones(1 << 22)
    assert float((x * 2).sum()) == 2.0 * (1 << 22)
torch.set_num_threads(2)
"""


def run(script: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COUNT) + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_release_ends_the_idle_pool_and_a_later_region_starts_a_new_one():
    before, idle, released, again = run(
        """
        before = threads()
        parallel_op()
        idle = threads()
        assert openmp.release_thread_pool()
        released = threads_once_at_most(before)
        parallel_op()
        print(before, idle, released, threads())
        """
    )
    assert int(idle) == int(before) + 1  # the second OpenMP thread, idle now
    assert int(released) == int(before)
    assert int(again) == int(idle)


def test_the_engine_loop_releases_the_pool_its_warm_up_left(default_model_dir):
    """EngineLoop.start warms up in the caller's thread, then ends that thread's pool: the engine
    thread is then the only OpenMP master (two masters made each decode step ~1.9x slower)."""
    idle, started = run(
        f"""
        import asyncio
        from pdserve.engine import LLMEngine
        from pdserve.config import EngineConfig
        from pdserve.engine_loop import EngineLoop
        engine = LLMEngine(EngineConfig(model={str(default_model_dir)!r}, dtype="float32",
                                        threads=2))
        parallel_op()
        idle = threads()
        loop = EngineLoop(engine)
        loop.start(asyncio.new_event_loop())
        print(idle, threads_once_at_most(idle))
        loop.stop()
        """
    )
    assert int(started) == int(idle)  # the idle OpenMP thread gone, the engine thread up


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to borrow one")
def test_a_decode_engine_steps_on_borrowed_cores_only_while_no_kv_is_on_its_way(
    default_model_dir,
):
    """EngineLoop(borrow_cpus=...): pinned to one core with one thread, a decode engine's steps
    take a second thread on the borrowed core while nothing is on its way to it, and keep to
    its own core while a reserved request's KV is (its prefill worker is computing, on that
    core); the engine thread itself stays on its own core throughout."""
    own, other = sorted(os.sched_getaffinity(0))[:2]
    *_, free, held, after, engine_cpus = run(  # after the engine's log lines
        f"""
        import asyncio
        from pdserve.engine import LLMEngine
        from pdserve.config import EngineConfig
        from pdserve.engine_loop import EngineLoop
        from pdserve.sampling_params import SamplingParams
        os.sched_setaffinity(0, {{{own}}})
        engine = LLMEngine(EngineConfig(model={str(default_model_dir)!r}, dtype="float32",
                                        threads=1))
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

        async def main():
            loop = EngineLoop(engine, warm_up=False, borrow_cpus=frozenset({{{other}}}),
                              may_borrow=lambda: not engine.kv_on_its_way())  # DecodeWorker's
            loop.start(asyncio.get_running_loop())
            async def threads_of_steps(rid):
                q = loop.open_stream(rid)
                await loop.call(lambda e: e.add_request(list(range(5, 40)), params, rid))
                seen = set()
                while not (await q.get()).finished:
                    seen.add(loop.threads_now)
                loop.close_stream(rid)
                return ",".join(map(str, sorted(seen)))
            free = await threads_of_steps("a")
            await loop.call(lambda e: e.reserve_request(list(range(100, 140)), params, "kv"))
            held = await threads_of_steps("b")
            await loop.call(lambda e: e.abort_request("kv"))
            after = await threads_of_steps("c")
            cpus = os.sched_getaffinity(loop._thread.native_id)
            loop.stop()
            print(free, held, after, ",".join(map(str, sorted(cpus))))

        asyncio.run(main())
        """
    )
    assert (free, held, after) == ("2", "1", "2")
    assert engine_cpus == str(own)
