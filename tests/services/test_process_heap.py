"""A server process moves what its startup allocated out of the garbage collector's generations
when it says READY: a full collection then walks only what serving allocated since (on the
gateway's ~200,000 startup objects one took ~90 ms, a pause of its event loop)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
import pdserve.services.gateway.server  # what the gateway imports (torch among it)
from pdserve.services import process
before = len(gc.get_objects())
process.ready("gateway", "127.0.0.1:1", "-")
print(json.dumps({"before": before, "frozen": gc.get_freeze_count(),
                  "tracked": len(gc.get_objects())}))
"""


def test_ready_freezes_the_startup_heap():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0] == "READY gateway 127.0.0.1:1 metrics=-"
    got = json.loads(out[1])
    assert got["before"] > 10_000  # the probe measures a real heap
    assert got["frozen"] >= 0.9 * got["before"]
    assert got["tracked"] < 0.01 * got["before"]
