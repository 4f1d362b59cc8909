"""Hang detection, in process: the gateway's watchdog (services/gateway/watchdog.py) evicts a worker
whose engine stops while streams run there, the streams resume on another worker with the same
output, and the worker rejoins once it moves again; a busy worker is never evicted."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from pdserve.services.gateway.config import GatewayConfig

from pdserve import Client, SamplingParams
from pdserve.step_cost import UNMEASURED_STEP_S
from tests.helpers import assert_no_leaks, wait_until, worker_stats
from tests.serve.conftest import start_cluster
from tests.serve.test_health import _pause

LONG = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8 + i] for i in range(8)]


def _listed(c, name: str):
    return c.gateway.registry.workers[c.workers[name].worker_id]


def _fast_ok(c) -> float:
    return c.gateway_metric("pdserve_probes_total", kind="fast", result="ok")


def _stream_all(address: str, prompts, params, started: threading.Barrier | None = None):
    """Each prompt streamed in a thread of its own; the token ids of each. ``started``: every
    stream waits there once it has its first two deltas."""

    def one(prompt):
        with Client(address, timeout=60) as client:
            got: list[int] = []
            for i, delta in enumerate(client.generate_stream(prompt, params)):
                got += delta.token_ids
                if started is not None and i == 1:
                    started.wait(30)
            return got

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_a_decode_worker_whose_engine_hangs_is_evicted_and_its_streams_resume(cluster):
    # The default hang detection; lease 3 s: heartbeats every second, so it registers again soon
    # after it moves.
    c = cluster(prefill=1, decode=2, config={}, lease_s=3.0)
    want = _stream_all(c.address, PROMPTS, LONG)  # undisturbed
    hung = _listed(c, "decode-0")
    started = threading.Barrier(len(PROMPTS) + 1)
    with ThreadPoolExecutor(1) as pool:
        streams = pool.submit(_stream_all, c.address, PROMPTS, LONG, started)
        started.wait(30)  # every stream has tokens: both decode workers are streaming
        assert hung.calls, "decode-0 serves none of the streams"
        on_hung = len(hung.calls)
        release, held = _pause(c, c.workers["decode-0"])  # its engine thread stops, not its loop
        stopped = time.monotonic()
        try:
            wait_until(lambda: hung.evicted, 10, "the eviction")
            detected = time.monotonic() - stopped
            reason = hung.evicted  # until it registers again (its heartbeats go on meanwhile)
            got = streams.result(60)
        finally:
            release.set()
    assert got == want
    # caught by its engine's progress in Stats (the real probe would take engine_timeout_s, 20 s)
    assert detected <= 5.0, detected
    assert reason.startswith("engine stuck: its step has run "), reason
    assert "its bound is 2.00 s (predicted 0.00 s" in reason  # a command: the floor
    assert c.gateway_metric("pdserve_evictions_total", reason="engine_stuck") == 1
    assert c.gateway_metric("pdserve_evictions_total", reason="stalled") == 0
    assert c.gateway_metric("pdserve_hang_detection_seconds_count") == 1
    # the worker's own account of its step's time when Stats answered: past the 2 s floor
    assert 2.0 < c.gateway_metric("pdserve_hang_detection_seconds_sum") <= 5.0
    assert c.gateway_metric("pdserve_resumes_total") == on_hung
    assert held.result(10) is True
    # Moving again, it answers its next heartbeat by registering, passes a probe and rejoins.
    wait_until(lambda: hung.alive, 10, "decode-0 to rejoin")
    assert c.gateway_metric("pdserve_rejoins_total") == 1
    assert hung.evicted is None and not hung.probation
    with Client(c.address, timeout=60) as client:
        for p in PROMPTS[:2]:  # least_loaded: the idle workers take turns
            assert list(client.complete(p, LONG).token_ids) == want[PROMPTS.index(p)]
    wait_until(lambda: c.served("decode-0") >= 1, 5, "decode-0 to serve again")
    assert_no_leaks(c.live())  # the cancelled streams' blocks were freed once it moved


def test_a_prefill_worker_whose_engine_hangs_is_evicted_and_its_requests_retried(cluster):
    c = cluster(prefill=2, decode=1, config={}, lease_s=3.0)
    want = _stream_all(c.address, PROMPTS, SHORT)  # undisturbed; both prefill workers stepped
    hung = _listed(c, "prefill-0")
    served = c.served("prefill-0")
    release, held = _pause(c, c.workers["prefill-0"])  # Stats answers, its engine does not
    stopped = time.monotonic()
    try:
        with ThreadPoolExecutor(1) as pool:
            streams = pool.submit(_stream_all, c.address, PROMPTS, SHORT)
            wait_until(lambda: hung.calls, 5, "a Prefill call on the hung worker")
            on_hung = len(hung.calls)
            wait_until(lambda: hung.evicted, 10, "the eviction")
            detected = time.monotonic() - stopped
            reason = hung.evicted
            got = streams.result(60)
        # Still hung, it registers again (its loop heartbeats) and stays on probation: its fast
        # probes answer, but with its step past the bound, so they do not pass.
        wait_until(lambda: hung.probation, 5, "it to register again, on probation")
        before = _fast_ok(c)
        wait_until(lambda: _fast_ok(c) >= before + 6, 10, "two more rounds of fast probes")
        assert hung.probation and not hung.alive
    finally:
        release.set()
    assert got == want
    assert detected <= 5.0, detected
    assert 2.0 < c.gateway_metric("pdserve_hang_detection_seconds_sum") <= 5.0
    assert reason.startswith("engine stuck: its step has run "), reason
    assert c.gateway_metric("pdserve_evictions_total", reason="engine_stuck") == 1
    assert c.gateway_metric("pdserve_retries_total") >= on_hung >= 1
    assert c.gateway_metric("pdserve_resumes_total") == 0  # no token had been streamed
    assert held.result(10) is True
    wait_until(lambda: hung.alive, 10, "prefill-0 to rejoin")  # its next fast probe passes
    assert c.gateway_metric("pdserve_rejoins_total") == 1
    with Client(c.address, timeout=60) as client:
        for p in PROMPTS[:4]:  # least_loaded: both prefill workers take turns again
            assert list(client.complete(p, SHORT).token_ids) == want[PROMPTS.index(p)]
    wait_until(lambda: c.served("prefill-0") > served, 5, "prefill-0 to prefill again")
    assert_no_leaks(c.live())


def test_a_worker_in_long_but_predicted_steps_is_not_evicted(default_model_dir):
    # The real default model, 256-token prefill chunks: each step takes far longer than a 0.3 s
    # floor on a CPU, and passes only because it is predicted from the ones before it
    # (pdserve/step_cost.py), or, predicted past LAYER_MARKS_S, because its layers mark progress
    # (what Stats reports is then the time since the last layer against a layer's share). Probed
    # every 20 ms.
    floor = 0.3
    config = dict(stuck_step_floor_s=floor, probe_interval_s=0.02, suspect_after_s=5.0)
    c = start_cluster(default_model_dir, prefill=0, decode=0, config=config)
    try:
        w = c.start_worker(
            "colocated-0", "colocated", max_num_batched_tokens=256, kv_cache_bytes=64 << 20
        )
        prompts = [[5 + (i * 257 + j) % 40000 for j in range(256)] for i in range(4)]
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        seen: list[tuple[float, float]] = []  # (busy_s, predicted_s) while a step runs
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                s = worker_stats(w.address, "colocated")
                if s.engine_busy_s > 0:
                    seen.append((s.engine_busy_s, s.engine_step_predicted_s))
                time.sleep(0.01)

        with ThreadPoolExecutor(1) as pool:
            watching = pool.submit(watch)
            try:
                got = _stream_all(c.address, prompts, params)
            finally:
                done.set()
            watching.result(10)
        assert [len(g) for g in got] == [3] * 4
        # steps predicted from measured ones (not the first step's default), never past the bound
        measured = [(b, p) for b, p in seen if 0 < p < UNMEASURED_STEP_S]
        assert measured, f"no step was seen running: {seen}"
        factor = GatewayConfig.stuck_step_factor
        assert all(b <= max(floor, factor * p) for b, p in seen), seen
        assert c.gateway_metric("pdserve_evictions_total", reason="engine_stuck") == 0
        assert c.gateway_metric("pdserve_probes_total", kind="fast", result="ok") > 10
        assert _listed(c, "colocated-0").alive
        assert_no_leaks(c.live())
    finally:
        c.close()


def test_a_busy_worker_is_probed_but_not_evicted(cluster):
    # Probes as often as the watchdog looks, and a worker suspect after 50 ms without a token.
    hasty = dict(
        probe_interval_s=0.05,
        real_probe_interval_s=0.05,
        suspect_after_s=0.05,
        probe_timeout_s=2.0,
        engine_timeout_s=2.0,
    )
    c = cluster(prefill=0, decode=0, colocated=1, config=hasty)
    prompts = [list(range(10, 10 + 200 + 10 * i)) for i in range(16)]  # 16 prefills, then decode
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    before = c.gateway_metric("pdserve_probes_total", kind="real", result="ok")
    got = _stream_all(c.address, prompts, params)
    assert [len(g) for g in got] == [300] * 16
    assert c.gateway_metric("pdserve_probes_total", kind="real", result="ok") > before
    assert c.gateway_metric("pdserve_evictions_total", reason="stalled") == 0
    assert c.gateway_metric("pdserve_evictions_total", reason="unresponsive") == 0
    assert c.gateway_metric("pdserve_evictions_total", reason="engine_stuck") == 0
    assert _listed(c, "colocated-0").alive
    # probes are not requests: the worker counted the 16 streams only
    wait_until(lambda: c.served("colocated-0") == 16, 5, "the worker to count the 16")
    assert_no_leaks(c.live())


def test_an_idle_worker_that_stops_answering_is_evicted_and_its_replacement_registers(cluster):
    c = cluster(prefill=0, decode=2, config={"probe_interval_s": 0.5})
    gone = _listed(c, "decode-0")
    c.stop_worker("decode-0")  # its server goes away while the gateway still lists it
    stopped = time.monotonic()
    wait_until(lambda: gone.evicted, 5, "the eviction")
    assert time.monotonic() - stopped <= 0.5 + 0.25 + GatewayConfig().probe_timeout_s + 2.0
    assert "its real probe: error" == gone.evicted
    assert c.gateway_metric("pdserve_evictions_total", reason="unresponsive") == 1
    # a new process (a new worker id) just registers
    c.start_worker("decode-2", "decode")
    assert _listed(c, "decode-2").alive
    with Client(c.address, timeout=30) as client:
        for i in range(4):
            assert client.complete([1, 2, 3 + i], SHORT).finish_reason == "length"
    assert c.served("decode-0") == 0
    assert_no_leaks(c.live())


def test_a_hung_idle_worker_is_evicted_and_kept_on_probation_until_it_moves(cluster):
    c = cluster(
        prefill=0,
        decode=0,
        colocated=2,
        # the real probe's verdict (engine progress would evict it too, later: at 2 s by default)
        config={"engine_timeout_s": 1.0, "real_probe_interval_s": 0.5, "stuck_step_floor_s": 30},
        lease_s=1.5,  # heartbeats every 0.5 s: it registers again while still hung
    )
    hung = _listed(c, "colocated-0")
    release, held = _pause(c, c.workers["colocated-0"])
    try:
        wait_until(lambda: hung.evicted, 5, "the eviction")
        assert hung.evicted == "its real probe: timeout"  # Stats answers: its loop runs
        assert c.gateway_metric("pdserve_evictions_total", reason="unresponsive") == 1
        wait_until(lambda: hung.probation, 5, "it to register again, on probation")
        with Client(c.address, timeout=30) as client:  # not routed to while on probation
            for i in range(4):
                assert client.complete([1, 2, 3 + i], SHORT).finish_reason == "length"
        assert c.served("colocated-0") == 0 and hung.probation and not hung.alive
        assert c.gateway_metric("pdserve_evictions_total", reason="unresponsive") == 1
    finally:
        release.set()
    assert held.result(10) is True
    wait_until(lambda: hung.alive, 5, "it to pass a probe and rejoin")
    assert c.gateway_metric("pdserve_rejoins_total") == 1
    assert_no_leaks(c.live())  # the probes it took while hung were freed


def test_a_prefill_worker_that_stops_answering_is_evicted_on_its_fast_probe(cluster):
    c = cluster(prefill=2, decode=1, config={"probe_interval_s": 0.5})
    gone = _listed(c, "prefill-0")
    c.stop_worker("prefill-0")
    wait_until(lambda: gone.evicted, 5, "the eviction")
    assert gone.evicted == "its fast probe: error"  # Stats is all a prefill worker is asked
    assert c.gateway_metric("pdserve_probes_total", kind="fast", result="error") >= 1
    assert c.gateway_metric("pdserve_evictions_total", reason="unresponsive") == 1
    with Client(c.address, timeout=30) as client:
        for i in range(4):
            assert client.complete([1, 2, 3 + i], SHORT).finish_reason == "length"
    assert c.gateway_metric("pdserve_retries_total") == 0  # never routed to once evicted
    assert_no_leaks(c.live())


@pytest.mark.parametrize(
    "field, value",
    [
        ("probe_interval_s", -1),
        ("suspect_after_s", 0),
        ("probe_timeout_s", 0),
        ("real_probe_timeout_s", -0.5),
        ("real_probe_interval_s", 0),
        ("engine_timeout_s", 0),
        ("stuck_step_floor_s", 0),
        ("stuck_step_factor", 0.5),
    ],
)
def test_hang_detection_bounds_are_checked(field, value):
    with pytest.raises(ValueError, match=f"{field} must be"):
        GatewayConfig(**{field: value})


def test_workers_have_measured_steps_before_their_first_request(cluster):
    """Workers warm up before they serve (EngineLoop._warm_up): their step prediction, which
    the engine_stuck bound is made of, is measured (not the unmeasured default) from the first
    request on, and the warm-up leaves no block or request behind."""
    c = cluster(prefill=1, decode=1)
    for w in c.workers.values():
        assert w.worker.loop.cost.predict(64) < UNMEASURED_STEP_S
    assert_no_leaks(c.live())


def test_an_engine_stuck_inside_a_long_step_is_evicted_within_the_floor(default_model_dir):
    # The real default model, one 1,024-token prefill chunk per step: predicted far above
    # LAYER_MARKS_S, so each layer done is a progress mark, and a layer that never ends is caught
    # at max(floor, 4 x a layer's share) = the 2 s floor, not at 4 x the whole step's prediction.
    c = start_cluster(default_model_dir, prefill=0, decode=0, config={})
    try:
        workers = [
            c.start_worker(
                f"colocated-{i}", "colocated", max_num_batched_tokens=1024, kv_cache_bytes=64 << 20
            )
            for i in range(2)
        ]
        prompt = [5 + (j * 257) % 40000 for j in range(1000)]
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        with Client(c.address, timeout=120) as client:
            want = list(client.complete(prompt, params).token_ids)
        held, release = threading.Event(), threading.Event()
        predicted: list[float] = []

        def hang_in_layer_10(loop):
            scheduled = loop.engine.on_schedule

            def on_schedule(num_tokens: int):
                mark = scheduled(num_tokens)
                if mark is None or held.is_set():
                    return mark
                predicted.append(loop._step_predicted_s)

                def layer_done(i: int) -> None:
                    mark(i)
                    if i == 10 and not held.is_set():
                        held.set()
                        release.wait(60)

                return layer_done

            loop.engine.on_schedule = on_schedule

        for w in workers:
            hang_in_layer_10(w.worker.loop)
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(_stream_all, c.address, [prompt], params)
            assert held.wait(60), "no step reached layer 10"
            hung_at = time.monotonic()
            wait_until(
                lambda: c.gateway_metric("pdserve_evictions_total", reason="engine_stuck") == 1,
                10,
                "the eviction",
            )
            detected = time.monotonic() - hung_at
            release.set()
            assert got.result(60) == [want]  # retried on the other worker
        factor, floor = GatewayConfig.stuck_step_factor, GatewayConfig.stuck_step_floor_s
        print(f"detected_s={detected:.2f} step_predicted_s={predicted[0]:.2f}")
        assert factor * predicted[0] > 2 * floor, predicted  # the whole step's bound: far longer
        assert floor <= detected <= floor + 1.0, detected
        assert_no_leaks(c.live())
    finally:
        c.close()
