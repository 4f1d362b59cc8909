"""Workers that fail: before the first token the gateway retries on another pair, after it the
client gets UNAVAILABLE. A failed worker is a real one: its gRPC server is stopped while the
gateway still lists it (its lease has not run out)."""

from __future__ import annotations

import grpc
import pytest
from pdserve.services.main import RegistrationRefusedError

from pdserve import Client, SamplingParams
from tests.helpers import assert_no_leaks, wait_until

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4 + i] for i in range(4)]


@pytest.mark.parametrize("failed", ["prefill-0", "decode-0"])
def test_a_worker_that_fails_before_the_first_token_is_retried_on_another(cluster, failed):
    c = cluster()
    with Client(c.address, timeout=30) as client:
        expected = [list(client.complete(p, PARAMS).token_ids) for p in PROMPTS]
        other = failed[:-1] + "1"
        wait_until(lambda: c.served(other) == c.served(failed) == 2, 5, "the workers to take turns")
        c.stop_worker(failed)
        before = c.gateway_metric("pdserve_retries_total")
        got = [list(client.complete(p, PARAMS).token_ids) for p in PROMPTS]
    assert got == expected
    # least_loaded: idle workers take turns, so the failed one is tried by the first or second
    # request; then it counts one failure and is not picked again while another is idle.
    assert c.gateway_metric("pdserve_retries_total") - before == 1
    assert c.gateway_metric("pdserve_requests_total", outcome="ok") == 2 * len(PROMPTS)
    wait_until(lambda: c.served(other) == 2 + len(PROMPTS), 5, f"{other} to serve the rest")
    assert_no_leaks(c.live())  # the decode worker admitted the failed try, then freed it


def test_when_every_pair_fails_the_client_gets_unavailable(cluster):
    c = cluster(prefill=1, decode=2)
    c.stop_worker("decode-0")
    c.stop_worker("decode-1")
    with Client(c.address, timeout=30) as client, pytest.raises(grpc.RpcError) as err:
        client.complete([1, 2, 3], PARAMS)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no worker could serve the request: decode worker" in err.value.details()
    assert c.gateway_metric("pdserve_retries_total") == 2
    assert_no_leaks(c.live())


def lose_the_only_decode_worker_mid_stream(c) -> None:
    """Stop decode-0 after a stream's first tokens: the stream ends with UNAVAILABLE."""
    with Client(c.address, timeout=60) as client:
        stream = client.generate_stream(
            [5, 6, 7], SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        )
        next(stream), next(stream)
        c.stop_worker("decode-0")
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith("no worker could serve the request: resuming after ")


def test_a_stream_whose_only_decode_worker_is_lost_ends_with_unavailable(cluster):
    c = cluster(prefill=1, decode=1)
    lose_the_only_decode_worker_mid_stream(c)
    assert c.gateway_metric("pdserve_resumes_total") == 1
    assert c.gateway_metric("pdserve_retries_total") == 0
    assert_no_leaks(c.live())


def test_past_max_resumes_a_stream_ends_with_unavailable(cluster):
    """max_resumes 0: the first mid-stream failure ends the stream, though a worker is left."""
    c = cluster(prefill=1, decode=2, config={"probe_interval_s": 0.0, "max_resumes": 0})
    with Client(c.address, timeout=30) as client:
        stream = client.generate_stream(
            [5, 6, 7], SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        )
        next(stream), next(stream)
        c.stop_worker(_serving(c, "decode"))
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "(0 resumes, at most 0)" in err.value.details()
    assert c.gateway_metric("pdserve_resumes_total") == 0
    assert_no_leaks(c.live())


def _serving(c, role: str) -> str:
    """The name of the ``role`` worker the gateway has a call running on."""
    busy = {w.address for w in c.gateway.registry.workers.values() if w.calls and w.role == role}
    (name,) = [n for n, w in c.workers.items() if w.address in busy]
    return name


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=50, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_decode_worker_lost_mid_stream_is_resumed_on_another_with_the_same_output(
    cluster, params
):
    c = cluster(prefill=1, decode=2)
    prompt = [5, 6, 7, 8, 9]
    with Client(c.address, timeout=60) as client:
        want = client.complete(prompt, params)
        stream = client.generate_stream(prompt, params)
        got = list(next(stream).token_ids) + list(next(stream).token_ids)
        c.stop_worker(_serving(c, "decode"))
        for delta in stream:
            got += delta.token_ids
            last = delta
    assert got == want.token_ids and len(got) == 40
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens == 5 and last.usage.completion_tokens == 40
    assert c.gateway_metric("pdserve_resumes_total") == 1
    assert_no_leaks(c.live())


def test_a_worker_with_another_kv_layout_is_refused_at_registration(cluster):
    c = cluster(prefill=0, decode=1)
    with pytest.raises(RegistrationRefusedError) as err:
        c.start_worker("prefill-32", "prefill", block_size=32)
    assert "has KV layout" in str(err.value)
    assert "start every worker with the same model, dtype and block size" in str(err.value)
    assert [w.role for w in c.gateway.registry.workers.values()] == ["decode"]
    assert_no_leaks(c.live())


def test_a_stream_whose_only_decode_worker_is_lost_waits_for_one_to_come_back(cluster):
    """Outage wait: nowhere to resume, so the request waits; a decode worker that registers
    meanwhile (a restarted one has a new id) takes the stream on, and the output is unchanged."""
    c = cluster(prefill=1, decode=1, config={"probe_interval_s": 0.0, "outage_wait_s": 60.0})
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with Client(c.address, timeout=60) as client:
        want = client.complete([5, 6, 7], params)
        stream = client.generate_stream([5, 6, 7], params)
        got = list(next(stream).token_ids) + list(next(stream).token_ids)
        c.stop_worker("decode-0")
        waiting = "pdserve_requests_waiting"
        wait_until(lambda: c.gateway_metric(waiting) == 1, 10, "the request to wait")
        c.start_worker("decode-1", "decode")
        for delta in stream:
            got += delta.token_ids
    assert got == want.token_ids and len(got) == 40
    assert c.gateway_metric(waiting) == 0
    assert c.gateway_metric("pdserve_resumes_total") == 1
    assert c.served("decode-1") == 1
    assert_no_leaks(c.live())


def test_past_the_outage_wait_and_with_no_worker_ever_the_client_gets_unavailable(cluster):
    c = cluster(prefill=0, decode=0, config={"probe_interval_s": 0.0, "outage_wait_s": 60.0})
    with Client(c.address, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.complete([1, 2, 3], PARAMS)  # never had a worker: no wait
    assert err.value.details() == "no worker could serve the request: no worker is registered"
    c = cluster(prefill=1, decode=1, config={"probe_interval_s": 0.0, "outage_wait_s": 0.5})
    lose_the_only_decode_worker_mid_stream(c)
    assert c.gateway_metric("pdserve_requests_waiting") == 0
    assert_no_leaks(c.live())
