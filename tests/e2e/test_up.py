"""``pdserve up`` as a script starts it (``pdserve up &``): it serves gRPC and the OpenAI-compatible
HTTP API (the official client gets the gRPC API's greedy output), restarts a process killed
outright, and one SIGINT stops it and every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai

from pdserve import Client, SamplingParams
from tests.e2e.cluster import Up
from tests.helpers import SERVING, health, process_alive, wait_until


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_up_serves_then_stops_everything_on_sigint_even_when_started_with_sigint_ignored():
    up = Up("--http-port", "0", "--kv-cache-bytes", "256M", "--log-format", "json")
    try:
        address, base_url, pids = up.address, up.base_url, up.pids
        assert base_url
        prompt = "What is the capital of France?"
        with Client(address, timeout=120) as client:
            out = client.complete(prompt, SamplingParams(max_tokens=8, temperature=0))
            chat = client.complete(
                [{"role": "user", "content": prompt}], SamplingParams(max_tokens=8, temperature=0)
            )
        assert len(out.token_ids) > 0
        with openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=120) as oai:
            model = oai.models.list().data[0].id
            got = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            got_chat = oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            chat_text = "".join(c.choices[0].delta.content or "" for c in got_chat if c.choices)
        assert got.choices[0].text == out.text
        assert got.usage.completion_tokens == len(out.token_ids)
        assert chat_text == chat.text
        workers = _children(up.proc.pid)
        assert len(workers) == 3  # gateway, prefill, decode
        for name in ("prefill-0", "decode-0"):  # up's --device (its default here) reaches them
            assert up.worker_option(name, "--device") == "cpu"

        # Supervision: a worker killed outright, and the gateway too, are started again (the
        # gateway on its ports; the workers register with it again) and the cluster serves.
        for name in ("decode-0", "gateway"):
            os.kill(pids[name], signal.SIGKILL)
            for line in up.proc.stdout:
                if line.startswith(f"pdserve up: {name} restarted (pid "):
                    pids[name] = int(line.split("(pid ")[1].split(",")[0])
                    break
            assert process_alive(pids[name]), f"{name} was not restarted"
        # The workers register again on their next heartbeat; until then the gateway says so.
        wait_until(lambda: health(address) == SERVING, 30, "the restarted gateway serves")
        with Client(address, timeout=120) as client:
            after = client.complete(prompt, SamplingParams(max_tokens=8, temperature=0))
        assert after.token_ids == out.token_ids
        workers = _children(up.proc.pid)
        assert sorted(workers) == sorted(pids.values())

        assert up.stop() == 0
        assert not [p for p in workers if process_alive(p)]  # `up` waited for each before it exited
    finally:
        up.kill()


def test_up_tls_serves_over_tls_with_the_printed_ca_and_removes_it_on_exit():
    up = Up(
        "--tls",
        "--kv-cache-bytes",
        "256M",
        "--log-format",
        "json",
        unset=("PDSERVE_CLUSTER_TOKEN",),
    )
    try:
        ca = up.words[up.words.index("--tls-ca") + 1]
        with Client(up.address, timeout=120, tls_ca=ca) as client:
            out = client.complete("Hello", SamplingParams(max_tokens=4, temperature=0))
        assert len(out.token_ids) > 0
        assert os.stat(os.path.join(os.path.dirname(ca), "worker.key")).st_mode & 0o077 == 0
        assert up.stop() == 0
        assert not os.path.exists(ca)
    finally:
        up.kill()


def test_a_worker_that_cannot_start_stops_pdserve_up_with_its_reason_and_no_traceback():
    """A KV pool larger than the machine's memory: the worker says so and exits; `up` said
    nothing of its own but a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "-1"]
        + ["--kv-cache-bytes", "100000G", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "a KV cache of 100000.0 GiB does not fit" in done.stderr
    assert "exited (code 2) before it was ready; stopping the rest" in done.stderr
    assert "Traceback" not in done.stderr
