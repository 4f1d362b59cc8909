"""Two gateway processes, workers registered with both through one ``--gateway`` list (an IP and a
name, as a headless Service would give): a request through either is served; one gateway killed,
the other keeps every worker listed and serves (the in-process cases are tests/serve)."""

from __future__ import annotations

import time

from pdserve.services.launcher import start_process, stop_processes

from pdserve import Client, SamplingParams
from tests.e2e.cluster import start_cluster
from tests.helpers import assert_no_leaks

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LEASE = ["--lease", "2"]


def test_workers_register_with_both_gateways_and_outlive_one():
    c = start_cluster(*LEASE)
    try:
        proc, g2, *_, registry2 = start_process(
            ["gateway", "--port", "0", "--http-port", "-1", *LEASE], env=c.env
        )
        c.procs.append(proc)
        port2 = registry2.rsplit(":", 1)[1]
        both = f"{c.gateway},localhost:{port2}"
        c.gateway = both  # what start_worker passes as --gateway
        c.start_worker("prefill", "prefill")
        c.start_worker("decode", "decode")
        g1 = both.split(",")[0]
        outputs = []
        for address in (g1, g2):
            with Client(address, timeout=60) as client:
                out = client.complete("The sea is", PARAMS)
            assert out.finish_reason == "length"
            outputs.append(out.token_ids)
        assert outputs[0] == outputs[1]

        c.procs[0].kill()  # the first gateway
        c.procs[0].wait()
        time.sleep(3 * 2)  # three leases: the workers' heartbeats to the other go on
        with Client(g2, timeout=60) as client:
            assert client.complete("The sea is", PARAMS).token_ids == outputs[0]
        assert all(p.poll() is None for p, *_ in c.workers.values())
        assert_no_leaks(c.live())
    finally:
        stop_processes(c.procs)
