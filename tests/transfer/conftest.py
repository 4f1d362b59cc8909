"""Transfer tests: UCX on loopback only, and a hard time limit on every test.

The UCX variables are set before ucxx is first imported, here and (inherited) in every spawned
peer process. A test that overruns its limit fails with TimeoutError (SIGALRM interrupts blocking
waits in the main thread); if even that does not end it, faulthandler dumps every thread's stack
and exits the run, so a hang can never stall the suite.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Iterator

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

TEST_TIME_LIMIT_S = 60


def _overrun(signum: int, frame: object) -> None:
    raise TimeoutError(f"test exceeded its {TEST_TIME_LIMIT_S} s limit")


@pytest.fixture(autouse=True)
def hard_time_limit() -> Iterator[None]:
    faulthandler.dump_traceback_later(TEST_TIME_LIMIT_S + 30, exit=True, file=sys.stderr)
    previous = signal.signal(signal.SIGALRM, _overrun)
    signal.alarm(TEST_TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
