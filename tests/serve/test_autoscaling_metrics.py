"""The gauges a HorizontalPodAutoscaler scales workers on (deploy/k8s): KV cache and batch
utilization, read from the engine at scrape time."""

from __future__ import annotations

from pdserve.metrics import WorkerMetrics
from tests.helpers import assert_no_leaks, seat_held, wait_until


def _gauge(worker, name: str) -> float:
    return worker.worker.metrics.registry.get_sample_value(name)


def test_utilization_gauges_are_fractions_of_capacity():
    m = WorkerMetrics()
    state = {"running": 3, "free": 250}
    m.watch(lambda: state["running"], lambda: 0, lambda: state["free"], 1000, 4)
    get = m.registry.get_sample_value
    assert get("pdserve_kv_cache_utilization") == 0.75
    assert get("pdserve_batch_utilization") == 0.75
    state.update(running=0, free=1000)
    assert get("pdserve_kv_cache_utilization") == 0.0
    assert get("pdserve_batch_utilization") == 0.0


def test_a_decode_worker_reports_its_reserved_kv_as_utilization(cluster):
    c = cluster(prefill=1, decode=1)
    d = c.workers["decode-0"]
    assert _gauge(d, "pdserve_kv_cache_utilization") == 0.0
    assert _gauge(d, "pdserve_batch_utilization") == 0.0
    total = d.engine.allocator.num_blocks
    with seat_held(d.address):  # admitted: blocks for prompt + max_tokens reserved
        used = _gauge(d, "pdserve_kv_cache_utilization")
        assert used == (total - d.engine.num_free_blocks) / total
        assert 0 < used < 1
    wait_until(lambda: _gauge(d, "pdserve_kv_cache_utilization") == 0.0, 10, "blocks freed")
    assert_no_leaks(c.live())
