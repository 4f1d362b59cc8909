"""How long the UCX worker thread sleeps on its fds (ucx_runtime.sleep_limit): a CUDA transport
with requests in flight polls (its copies may not wake the fd); otherwise it sleeps until a
timer, at most MAX_SLEEP_S."""

from __future__ import annotations

from pdserve.transfer.ucx_runtime import CUDA_IN_FLIGHT_SLEEP_S, MAX_SLEEP_S, sleep_limit


def test_cuda_with_requests_in_flight_polls() -> None:
    assert sleep_limit(cuda=True, in_flight=True, next_timer=None) == CUDA_IN_FLIGHT_SLEEP_S
    assert sleep_limit(cuda=True, in_flight=True, next_timer=5.0) == CUDA_IN_FLIGHT_SLEEP_S
    assert CUDA_IN_FLIGHT_SLEEP_S <= 0.001


def test_otherwise_it_sleeps_until_the_next_timer_or_the_cap() -> None:
    for cuda, in_flight in ((False, True), (False, False), (True, False)):
        assert sleep_limit(cuda, in_flight, None) == MAX_SLEEP_S
        assert sleep_limit(cuda, in_flight, 0.25) == 0.25
        assert sleep_limit(cuda, in_flight, 60.0) == MAX_SLEEP_S
        assert sleep_limit(cuda, in_flight, -1.0) == 0.0  # a timer already due: no sleep
