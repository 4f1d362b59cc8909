"""The prompt order at a real prefill worker (``--prompt-order shortest``, the default): a short
prompt that reaches it while a long one is being computed is computed at the next chunk boundary,
its KV shipped and its stream begun before the long one's, and both streams give the tokens of an
undisturbed run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve import Client, SamplingParams
from tests.helpers import assert_no_leaks, wait_until

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG = [5 + (j * 37) % 900 for j in range(200)]  # 13 steps of 16 tokens
SHORT = list(range(1000, 1040))


def _stream(address: str, prompt: list[int]) -> tuple[float, list[int]]:
    """(when the first message came, time.monotonic(); the tokens)."""
    first, tokens = None, []
    with Client(address, timeout=60) as client:
        for msg in client.generate_stream(prompt, PARAMS):
            first = first or time.monotonic()
            tokens += msg.token_ids
    return first, tokens


def _hold_second_step(loop) -> tuple[threading.Event, threading.Event]:
    """The engine thread of ``loop`` stops in its second step from now (before the forward)
    until the returned ``release`` is set; ``held`` is set once it has stopped."""
    held, release = threading.Event(), threading.Event()
    scheduled, steps = loop.engine.on_schedule, []

    def on_schedule(num_tokens: int):
        steps.append(num_tokens)
        if len(steps) == 2:
            held.set()
            release.wait(60)
        return scheduled(num_tokens) if scheduled is not None else None

    loop.engine.on_schedule = on_schedule
    return held, release


def test_a_short_prompt_behind_a_long_one_streams_first_with_the_same_tokens(cluster):
    c = cluster(prefill=0, decode=1)  # the budget 0: every prompt goes to the prefill worker
    # no prefix cache: the reference runs below would leave the prompts cached there
    prefill = c.start_worker(
        "prefill-0", "prefill", max_num_batched_tokens=16, prefix_caching=False
    )
    wait_until(lambda: len(c.gateway.gateway.registry.workers) == 2, 10, "both workers listed")
    want = {name: _stream(c.address, p)[1] for name, p in (("long", LONG), ("short", SHORT))}
    held, release = _hold_second_step(prefill.worker.loop)
    try:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(_stream, c.address, LONG)
            assert held.wait(30), "the long prompt's second chunk was never scheduled"
            short = pool.submit(_stream, c.address, SHORT)
            # its prompt is handed to the engine thread between steps: queued there
            queued = prefill.worker.loop._commands.qsize
            wait_until(lambda: queued() >= 1, 10, "the short prompt to reach the engine")
            release.set()
            (long_first, long_tokens), (short_first, short_tokens) = (
                long.result(60),
                short.result(60),
            )
    finally:
        release.set()
    assert short_first < long_first
    assert not prefill.worker.loop.engine.scheduler.waiting
    assert (long_tokens, short_tokens) == (want["long"], want["short"])
    assert_no_leaks(c.live())
