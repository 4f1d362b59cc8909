"""Real processes dying (SIGKILL), a UCX transfer whose sender dies half way, a worker refused at
registration (exit code 2): each with a cluster of its own. Retries before the first token, no
worker, the colocated fallback and a full decode worker are the in-process tier's (tests/serve)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pdserve.services.launcher import stop_processes

from pdserve import Client, SamplingParams
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster import UCX_ENV, WORKER_ARGS, start_cluster
from tests.helpers import assert_no_leaks, wait_until

LONG_PROMPT = " ".join(
    ["river stone light music engine garden"] * 300
)  # ~1,800 tokens: prefill takes seconds


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


def test_the_only_decode_killed_mid_stream_gives_an_error_after_the_outage_wait(fresh):
    """Nowhere to resume (test_resume.py has the case with another decode worker): the request
    waits --outage-wait for a decode worker to come back (tests/serve/test_retries.py has one
    that does), then UNAVAILABLE."""
    c = fresh("--outage-wait", "1")
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
    assert 1 <= time.monotonic() - killed < 6
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # the client read 2 tokens before the kill; the gateway may have sent it more by then
    sent = re.search(r"resuming after (\d+) tokens", err.value.details())
    assert sent is not None and int(sent.group(1)) >= 2, err.value.details()
    assert_no_leaks(c.live())  # the prefill worker


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
    assert_no_leaks(c.live(), timeout=0)


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
        env={**os.environ, **UCX_ENV, **c.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "gateway refused registration" in proc.stderr and "has KV layout" in proc.stderr
    assert "same model, dtype and block size" in proc.stderr


def test_prompts_queued_longer_than_the_kv_timeout_are_prefilled_once(fresh):
    """A decode worker holds a prompt's blocks for --kv-timeout beyond the wait expected at the
    prefill worker: three long prompts at once to one single-threaded prefill worker, the last
    waiting there seconds for the others, are all answered on their first attempt (with a hold
    of --kv-timeout alone the later ones timed out waiting and, --max-attempts 1, failed)."""
    c = fresh("--kv-timeout", "0.5", "--max-attempts", "1")
    c.start_worker("prefill", "prefill")
    c.start_worker("decode", "decode")
    # ~1,230 tokens each: the last prompt waits behind ~2,500 prompt tokens, past the 0.5 s
    # timeout even on one AVX512-BF16 core (~1,700 tokens/s; ~430-token prompts did not)
    body = " ".join(["river stone light music engine garden"] * 200)
    prompts = [f"{word} {body}" for word in ("alpha", "bravo", "charlie")]  # no shared prefix
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Client(c.gateway, timeout=120) as client, ThreadPoolExecutor(3) as pool:
        started = time.monotonic()
        outs = list(pool.map(lambda p: client.complete(p, params), prompts))
        took = time.monotonic() - started
    assert [len(o.token_ids) for o in outs] == [2, 2, 2]
    assert took > 1, f"the prompts took {took:.1f} s in all: none waited past the timeout"
    assert_no_leaks(c.live())
