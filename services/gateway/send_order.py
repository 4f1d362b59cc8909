"""Prompts leave for a prefill worker in the order their KV holds were sized.

A disaggregated request's KV hold (``cost.kv_hold_s``: how long the decode worker keeps its blocks
for the prefill worker's KV) is sized when the request is routed, from what is queued at the
prefill worker then. Its prefill call goes out only after the decode worker has admitted it, a
round trip whose length varies. Prompts routed to one prefill worker a few milliseconds apart
could therefore reach it in another order than the one their holds assumed: on a fresh-clone test
run, three 1,200-token prompts sent 3 ms apart reached a one-thread prefill worker last-routed
first, and the first one, whose hold counted no queue, was still being sent at layer 20 of 30
when its hold ran out (``tests/e2e/test_failures.py``). A ``SendOrder`` per prefill worker lets a
prompt's call go only after those routed there before it have gone (or given up), waiting at most
``limit_s`` for them: the order holds, and a slow admission delays the others by no more than that.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

ORDER_WAIT_S = 0.1  # most a prefill call waits for calls routed before it to go out


class SendOrder:
    """Tickets in routing order: ``enter`` when a request is routed, ``await turn`` before its
    call goes out, ``leave`` once it has (or the request ended without one)."""

    def __init__(self) -> None:
        self._pending: deque[asyncio.Future] = deque()

    def enter(self) -> asyncio.Future:
        ticket = asyncio.get_running_loop().create_future()
        self._pending.append(ticket)
        return ticket

    async def turn(self, ticket: asyncio.Future, limit_s: float = ORDER_WAIT_S) -> bool:
        """Wait until every ticket entered before ``ticket`` has left, at most ``limit_s``;
        whether they all had."""
        earlier = list(itertools.takewhile(lambda t: t is not ticket, self._pending))
        if not earlier:
            return True
        _, pending = await asyncio.wait(earlier, timeout=limit_s)
        return not pending

    def leave(self, ticket: asyncio.Future) -> None:
        if not ticket.done():
            ticket.set_result(None)
        try:
            self._pending.remove(ticket)
        except ValueError:  # left already
            pass

    def __len__(self) -> int:
        return len(self._pending)
