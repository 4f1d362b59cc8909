"""Prompts leave for a prefill worker in the order their KV holds were sized
(services/gateway/send_order.py)."""

from __future__ import annotations

import asyncio

from pdserve.services.gateway.send_order import SendOrder


def test_calls_go_in_routing_order_whatever_order_their_admissions_end():
    """Three requests routed 1, 2, 3; their admissions end 3, 2, 1: their calls still go 1, 2, 3."""

    async def main():
        order, sent = SendOrder(), []
        tickets = [order.enter() for _ in range(3)]
        admitted = [asyncio.Event() for _ in range(3)]

        async def request(i):
            await admitted[i].wait()
            assert await order.turn(tickets[i], limit_s=30)
            sent.append(i)
            order.leave(tickets[i])

        tasks = [asyncio.create_task(request(i)) for i in range(3)]
        for i in (2, 1, 0):
            admitted[i].set()
            await asyncio.sleep(0)  # let it run as far as it can
        await asyncio.gather(*tasks)
        assert sent == [0, 1, 2]
        assert len(order) == 0

    asyncio.run(main())


def test_a_request_that_ends_before_its_call_releases_those_after_it():
    async def main():
        order = SendOrder()
        first, second = order.enter(), order.enter()
        waiting = asyncio.create_task(order.turn(second, limit_s=30))
        await asyncio.sleep(0)
        assert not waiting.done()
        order.leave(first)  # its admission failed: no call
        assert await waiting is True
        order.leave(second)
        order.leave(second)  # twice (the call went, then the request ended): harmless
        assert len(order) == 0

    asyncio.run(main())


def test_a_stuck_admission_delays_the_others_by_at_most_the_limit():
    async def main():
        order = SendOrder()
        stuck, mine = order.enter(), order.enter()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await order.turn(mine, limit_s=0.05) is False  # went without it
        assert 0.05 <= loop.time() - started < 5
        order.leave(mine)
        assert len(order) == 1  # the stuck one is still pending, first in line
        third = order.enter()
        assert await order.turn(third, limit_s=0.01) is False
        order.leave(stuck)
        order.leave(third)
        assert await order.turn(order.enter(), limit_s=30) is True  # nobody before it now

    asyncio.run(main())
