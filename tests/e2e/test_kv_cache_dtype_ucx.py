"""bf16 KV pools under an fp32 model (``--kv-cache-dtype bfloat16``) between real processes: the
prefill worker's bf16 blocks travel over UCX as they are (half the bytes of fp32 ones) into the
decode worker's bf16 pools, and the greedy tokens are those of one engine with a bf16 KV cache;
a worker whose KV cache has another dtype is refused at registration, saying so. A small
random-weight Llama with a word tokenizer (tests/e2e/test_gpu_cluster.py's), so that the
processes start fast; the default model's accuracy with a bf16 KV cache is measured in
tests/engine/test_kv_cache_dtype.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from pdserve.services.launcher import stop_processes

from bench.random_model import write_word_tokenizer
from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from pdserve.kv_cache.pool import bytes_per_block
from pdserve.model.config import ModelConfig
from tests.e2e.cluster import UCX_ENV, WORKER_ARGS, start_cluster
from tests.engine.conftest import build_tiny_model
from tests.helpers import assert_no_leaks, metric_value

VOCAB = 512  # build_tiny_model's; ids 1 and 2 are its bos and eos
BLOCK = 16  # the workers' KV block size (the default)
BF16_KV = ("--dtype", "float32", "--kv-cache-dtype", "bfloat16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-bf16-tiny")
    build_tiny_model(folder, "gqa_untied")
    write_word_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture(scope="module")
def cluster(model):
    """A gateway, a prefill and a decode worker, both fp32 with bf16 KV pools."""
    c = start_cluster("--model", str(model))
    try:
        for role in ("prefill", "decode"):
            c.start_worker(role, role, "--model", str(model), *BF16_KV)
        yield c
    finally:
        stop_processes(c.procs)


def prompt(seed: int, length: int) -> list[int]:
    return [1] + [3 + (seed * 7 + i * 13) % (VOCAB - 3) for i in range(length - 1)]


def test_bf16_kv_disaggregated_over_ucx_decodes_the_tokens_of_one_bf16_kv_engine(model, cluster):
    llm = LLM(
        str(model),
        dtype="float32",
        kv_cache_dtype="bfloat16",
        cache=CacheConfig(kv_cache_bytes=8 << 20),
    )
    assert llm.engine.runner.pool.dtype == torch.bfloat16
    prompts = [prompt(1, 9), prompt(2, 40), prompt(3, 70)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [llm.generate([p], params)[0].token_ids for p in prompts]  # one at a time
    del llm

    def received() -> float:
        return metric_value(
            cluster.metrics["decode"], "pdserve_kv_transfer_bytes_sum", direction="recv"
        )

    before = received()
    with Client(cluster.gateway, timeout=120) as client:
        got = [list(client.complete(p, params).token_ids) for p in prompts]
    assert got == expected
    # the blocks came as bf16, 2 bytes a value (each transfer adds its plan and trailer, < 1 KiB;
    # fp32 blocks would be twice the bytes)
    blocks = sum(-(-len(p) // BLOCK) for p in prompts)
    per_block = bytes_per_block(ModelConfig.from_file(model / "config.json"), BLOCK, torch.bfloat16)
    assert 0 <= received() - before - blocks * per_block < len(prompts) * 1024
    assert_no_leaks(cluster.live())


def test_a_decode_worker_with_an_fp32_kv_cache_is_refused_beside_bf16_ones(model, cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--gateway", cluster.gateway]
        + [
            *WORKER_ARGS,
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "float32",
        ],
        env={**os.environ, **UCX_ENV, **cluster.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gateway refused registration" in proc.stderr and "has KV layout" in proc.stderr
    assert "the same KV cache dtype (--kv-cache-dtype)" in proc.stderr
    assert_no_leaks(cluster.live())
