"""Workers dying, transfers failing half way, mismatched layouts: each with a cluster of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from pdserve.services.launcher import stop_processes

from pdserve import Client, SamplingParams
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster import UCX_ENV, WORKER_ARGS, start_cluster

LONG_PROMPT = " ".join(
    ["river stone light music engine garden"] * 300
)  # ~1,800 tokens: prefill takes seconds


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def fresh():
    clusters = []

    def make(*gateway_args):
        c = start_cluster(*gateway_args)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        stop_processes(c.procs)


def test_decode_killed_mid_stream_gives_an_error_within_5s(fresh):
    c = fresh()
    c.start_worker("prefill", "prefill")
    c.start_worker("decode", "decode")
    with Client(c.gateway, timeout=60) as client:
        stream = client.generate_stream(
            "Tell me a long story.", SamplingParams(max_tokens=3000, ignore_eos=True)
        )
        next(stream)
        next(stream)
        c.kill("decode")
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert time.monotonic() - killed < 5
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "mid-stream" in err.value.details()


def test_prefill_killed_before_answering_is_retried_on_the_other(fresh):
    c = fresh()
    c.start_worker("prefill-a", "prefill")
    c.start_worker("prefill-b", "prefill")
    c.start_worker("decode", "decode")
    result = {}

    def run():
        with Client(c.gateway, timeout=120) as client:
            result["r"] = client.complete(
                LONG_PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            )

    t = threading.Thread(target=run)
    t.start()
    # Whichever prefill worker took the request: kill it while it computes.
    busy = []
    wait_until(
        lambda: (
            busy.extend(n for n in ("prefill-a", "prefill-b") if c.stats(n).num_running) or busy
        ),
        30,
        "a prefill worker to start the request",
    )
    c.kill(busy[0])
    t.join(timeout=120)
    assert len(result["r"].token_ids) == 4 and result["r"].finish_reason == "length"
    stats = c.wait_all_free(timeout=2)
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats.values()), stats


def test_transfer_whose_prefill_dies_half_way_frees_decode_blocks_by_the_deadline(fresh):
    """Driven below the gateway: admit on the decode worker, prefill on a worker that is killed."""
    c = fresh()
    c.start_worker("prefill", "prefill")
    c.start_worker("decode", "decode")
    from pdserve.model.fetch import DEFAULT_MODEL, resolve_model
    from pdserve.tokenizer import Tokenizer

    ids = Tokenizer.from_folder(resolve_model(DEFAULT_MODEL)).encode(LONG_PROMPT)
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0)
    d_addr, p_addr = c.workers["decode"][1], c.workers["prefill"][1]
    with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
        call = worker_pb2_grpc.DecodeStub(dch).Generate(
            worker_pb2.DecodeRequest(
                request_id="r1", prompt_token_ids=ids, sampling=sampling, kv_timeout_ms=3000
            ),
            timeout=30,
        )
        admitted = next(call).admitted
        assert c.stats("decode").num_free_blocks < c.stats("decode").num_total_blocks
        pending = worker_pb2_grpc.PrefillStub(pch).Prefill.future(
            worker_pb2.PrefillRequest(
                request_id="r1",
                prompt_token_ids=ids,
                sampling=sampling,
                destination=admitted.destination,
            )
        )
        wait_until(lambda: c.stats("prefill").num_running == 1, 10, "the prefill to start")
        c.kill("prefill")
        started = time.monotonic()
        assert pending.exception() is not None  # the prefill call died with its worker
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "layers arrived" in err.value.details()
    assert time.monotonic() - started < 3 + 2
    stats = c.stats("decode")
    assert stats.num_free_blocks == stats.num_total_blocks


def test_mismatched_kv_layout_is_refused_at_registration(fresh):
    c = fresh()
    c.start_worker("decode", "decode")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "prefill",
            "--gateway",
            c.gateway,
            *WORKER_ARGS,
            "--block-size",
            "32",
        ],
        env={**os.environ, **UCX_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "gateway refused registration" in proc.stderr and "has KV layout" in proc.stderr
    assert "same model, dtype and block size" in proc.stderr


def test_no_worker_answers_unavailable_within_seconds(fresh):
    c = fresh()
    t = time.monotonic()
    with Client(c.gateway, timeout=30) as client, pytest.raises(grpc.RpcError) as err:
        client.complete("hi", SamplingParams(max_tokens=2))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t < 5


def test_colocated_fallback_when_no_prefill_worker(fresh):
    c = fresh()
    c.start_worker("colo", "colocated")
    with Client(c.gateway, timeout=60) as client:
        r = client.complete(
            "What is the capital of France?", SamplingParams(max_tokens=8, temperature=0)
        )
    assert len(r.token_ids) >= 1
