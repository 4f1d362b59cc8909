from __future__ import annotations

import pytest
from pdserve.services.launcher import stop_processes

from tests.e2e.cluster import start_cluster


@pytest.fixture(scope="module")
def cluster():
    """gateway + 2 prefill + 1 decode, shared by the tests of a module that leave it intact."""
    c = start_cluster()
    try:
        c.start_worker("prefill-a", "prefill")
        c.start_worker("prefill-b", "prefill")
        c.start_worker("decode", "decode")
        yield c
    finally:
        stop_processes(c.procs)
