"""The whole served path on a GPU, as real processes: gateway -> prefill worker (`--device cuda`)
-> KV over UCX from CUDA memory -> decode worker (`--device cuda`, CUDA graphs) -> tokens back.
The in-process tests prove each part on a GPU (engine, kernels, UCX between devices); this one
proves the processes put together, as an operator runs them. A GPU machine here has no model hub
and not the default model, so the model is a small random-weight Llama with a word-level
tokenizer of its own (prompts are sent as token ids, the gateway detokenizes the answers).
Greedy tokens equal a single engine's on the same device (one request at a time, so both run the
same shapes), a shared prefix is reused from the decode worker's GPU blocks, and no block leaks.
The same on the CPU runs everywhere and proves the test itself."""

from __future__ import annotations

import concurrent.futures

import pytest

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from tests.e2e.cluster import Up
from tests.e2e.tiny import BLOCK, prompt, tiny_model_folder, tiny_pair
from tests.gpu import DEVICES
from tests.helpers import assert_no_leaks, metric_value


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory, "gpu-served-tiny")


@pytest.fixture(scope="module", params=DEVICES)
def cluster(request, model):
    """The workers on the device (the CPU run proves the test itself, everywhere)."""
    with tiny_pair(model, "--device", request.param) as c:
        c.device = request.param
        yield c


def test_greedy_tokens_equal_one_engine_on_the_device_and_a_shared_prefix_is_reused(model, cluster):
    llm = LLM(str(model), device=cluster.device, cache=CacheConfig(kv_cache_bytes=64 << 20))
    shared = prompt(0, 5 * BLOCK)
    prompts = [prompt(1, 9), prompt(2, 40), shared + prompt(3, 12)[1:], shared + prompt(4, 20)[1:]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [llm.generate([p], params)[0].token_ids for p in prompts]  # one at a time
    del llm

    got, cached = [], []
    reused_before = metric_value(cluster.metrics["decode"], "pdserve_kv_prefix_reused_tokens_total")
    with Client(cluster.gateway, timeout=120) as client:
        for p in prompts:
            r = client.complete(p, params)
            got.append(list(r.token_ids))
            cached.append(r.usage.cached_prompt_tokens)
            assert r.text.split() == [f"w{t}" for t in r.token_ids]  # the gateway's detokenizer
    reused = (
        metric_value(cluster.metrics["decode"], "pdserve_kv_prefix_reused_tokens_total")
        - reused_before
    )
    assert got == expected
    # prompts 3 and 4 share 5 whole blocks: prompt 4 is sent only the blocks after them
    assert cached == [0, 0, 0, 5 * BLOCK]
    assert reused == 5 * BLOCK
    assert_no_leaks(cluster.live())


def test_32_concurrent_streams_complete_on_the_device_and_free_every_block(cluster):
    jobs = [(prompt(10 + i, 4 + (i * 37) % 200), 1 + (i * 11) % 32) for i in range(32)]

    def run(job) -> int:
        p, n = job
        with Client(cluster.gateway, timeout=180) as c:
            deltas = list(
                c.generate_stream(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            )
        return sum(len(d.token_ids) for d in deltas)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        counts = list(pool.map(run, jobs))
    assert counts == [n for _, n in jobs]
    assert_no_leaks(cluster.live())


@pytest.mark.parametrize("device", DEVICES)
def test_pdserve_up_runs_its_workers_on_the_device(model, device):
    """`pdserve up --device` reached no worker (they ran on the CPU whatever it said)."""
    up = Up(
        "--model", str(model), "--device", device, "--http-port", "-1", "--kv-cache-bytes", "64M"
    )
    try:
        assert [up.worker_option(w, "--device") for w in ("prefill-0", "decode-0")] == [device] * 2
        llm = LLM(str(model), device=device, cache=CacheConfig(kv_cache_bytes=64 << 20))
        p = prompt(5, 30)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        expected = llm.generate([p], params)[0].token_ids
        with Client(up.address, timeout=120) as client:
            assert list(client.complete(p, params).token_ids) == expected
        assert up.stop() == 0
    finally:
        up.kill()
