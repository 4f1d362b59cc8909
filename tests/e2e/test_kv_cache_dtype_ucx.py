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

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from pdserve.kv_cache.pool import bytes_per_block
from pdserve.model.config import ModelConfig
from tests.e2e.cluster import UCX_ENV, WORKER_ARGS
from tests.e2e.tiny import BLOCK, prompt, tiny_model_folder, tiny_pair
from tests.helpers import assert_no_leaks, metric_value

BF16_KV = ("--dtype", "float32", "--kv-cache-dtype", "bfloat16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory, "kv-bf16-tiny")


@pytest.fixture(scope="module")
def cluster(model):
    """A gateway, a prefill and a decode worker, both fp32 with bf16 KV pools."""
    with tiny_pair(model, *BF16_KV) as c:
        yield c


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
