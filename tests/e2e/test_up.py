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
from tests.helpers import SERVING, health, process_alive, wait_until


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_up_serves_then_stops_everything_on_sigint_even_when_started_with_sigint_ignored():
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    # A non-interactive shell starts background jobs with SIGINT ignored; so does this.
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--port",
            "0",
            "--http-port",
            "0",
            "--kv-cache-bytes",
            "256M",
            "--log-format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        address = base_url = None
        for line in up.stdout:  # blocks until `up` prints; it exits (EOF) if it fails
            if line.startswith("pdserve is up: gateway at "):
                address = line.split()[5]
            if line.startswith("OpenAI-compatible HTTP API: "):
                base_url = line.split()[-1]
            if line.startswith("processes: "):  # "processes: gateway pid 1 at host:port, ..."
                pids = {p.split()[0]: int(p.split()[2]) for p in line[11:].split(", ")}
                break
        assert address and base_url, f"pdserve up exited with {up.wait()} before it was up"
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
        workers = _children(up.pid)
        assert len(workers) == 3  # gateway, prefill, decode
        for name in ("prefill-0", "decode-0"):  # up's --device (its default here) reaches them
            with open(f"/proc/{pids[name]}/cmdline") as f:
                argv = f.read().split("\0")
            assert argv[argv.index("--device") + 1] == "cpu"

        # Supervision: a worker killed outright, and the gateway too, are started again (the
        # gateway on its ports; the workers register with it again) and the cluster serves.
        for name in ("decode-0", "gateway"):
            os.kill(pids[name], signal.SIGKILL)
            for line in up.stdout:
                if line.startswith(f"pdserve up: {name} restarted (pid "):
                    pids[name] = int(line.split("(pid ")[1].split(",")[0])
                    break
            assert process_alive(pids[name]), f"{name} was not restarted"
        # The workers register again on their next heartbeat; until then the gateway says so.
        wait_until(lambda: health(address) == SERVING, 30, "the restarted gateway serves")
        with Client(address, timeout=120) as client:
            after = client.complete(prompt, SamplingParams(max_tokens=8, temperature=0))
        assert after.token_ids == out.token_ids
        workers = _children(up.pid)
        assert sorted(workers) == sorted(pids.values())

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert not [p for p in workers if process_alive(p)]  # `up` waited for each before it exited
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_tls_serves_over_tls_with_the_printed_ca_and_removes_it_on_exit():
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    env.pop("PDSERVE_CLUSTER_TOKEN", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--tls", "--port", "0"]
        + ["--kv-cache-bytes", "256M", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        words = None
        for line in up.stdout:  # blocks until `up` prints; it exits (EOF) if it fails
            if line.startswith("pdserve is up: gateway at "):
                words = line.split()
                break
        assert words, f"pdserve up --tls exited with {up.wait()} before it was up"
        address, ca = words[5], words[words.index("--tls-ca") + 1]
        with Client(address, timeout=120, tls_ca=ca) as client:
            out = client.complete("Hello", SamplingParams(max_tokens=4, temperature=0))
        assert len(out.token_ids) > 0
        assert os.stat(os.path.join(os.path.dirname(ca), "worker.key")).st_mode & 0o077 == 0
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert not os.path.exists(ca)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
