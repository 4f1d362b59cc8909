from __future__ import annotations

import pytest

from tests.e2e.cluster import running_cluster


@pytest.fixture(scope="module")
def cluster():
    """gateway + 2 prefill + 1 decode, shared by the tests of a module that leave it intact."""
    with running_cluster({"prefill-a": "prefill", "prefill-b": "prefill", "decode": "decode"}) as c:
        yield c
