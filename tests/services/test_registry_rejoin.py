"""The registry's side of hang detection: an evicted worker that registers again is on probation
(listed, heartbeats accepted, not routed to) until the watchdog says a probe passed."""

from __future__ import annotations

import asyncio

from pdserve.services.gateway.registry import WorkerRegistry


class _Call:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_an_evicted_worker_rejoins_on_probation_then_is_routed_to():
    async def scenario() -> None:
        reg = WorkerRegistry(lease_s=10)
        reg.probation_on_rejoin = True
        w = reg.register("d1", "decode", "127.0.0.1:1", "h")
        call = _Call()
        w.track(call)
        w.failures = 3
        reg.evict(w, "hung")
        assert call.cancelled and not w.alive and not w.registered
        assert reg.heartbeat("d1") is False  # answered known=false: it registers again
        # while its cancelled call unwinds it stays evicted (the call must see why)
        assert reg.register("d1", "decode", "127.0.0.1:1", "h") is w and w.evicted == "hung"
        w.calls.discard(call)
        assert reg.register("d1", "decode", "127.0.0.1:1", "h") is w
        assert w.evicted is None and w.probation
        assert w.registered and not w.alive and reg.alive("decode") == []
        assert reg.heartbeat("d1") is True  # its lease runs while on probation
        assert not reg.can_serve()
        reg.rejoined(w)
        assert w.alive and w.failures == 0 and reg.alive("decode") == [w]
        # a worker that left (drains) is not evicted-and-probed: it just registers again
        assert reg.deregister("d1") and w.deregistered
        reg.register("d1", "decode", "127.0.0.1:1", "h")
        assert w.alive and not w.deregistered and not w.probation
        await w.channel.close()

    asyncio.run(scenario())
