"""What ``pdserve bench offline --device cuda`` counts as a decode step's bytes (pdserve/bench_gpu.py):
the weights the engine holds and, per token of context, the KV that its pools store. The
bandwidth and the MBU itself need a GPU (scripts/gpu-check runs the benchmark)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench_gpu import decode_bytes_per_step, kv_bytes_per_token
from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_bytes_are_the_weights_and_the_pools_bytes_per_token(tiny_model, dtype):
    folder, hf = tiny_model("gqa_untied")
    engine = LLMEngine(
        EngineConfig(model=str(folder), dtype=dtype, cache=CacheConfig(kv_cache_bytes=1 << 22))
    )
    pools = engine.runner.pool
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in pools.kv_caches)
    per_token = pool_bytes // (pools.num_blocks * pools.block_size)
    assert kv_bytes_per_token(engine) == per_token
    itemsize = torch.tensor([], dtype=engine.dtype).element_size()
    # every tensor once, less the untied embedding table (a step reads only its looked-up rows)
    read = [p for name, p in hf.named_parameters() if name != "model.embed_tokens.weight"]
    weights = sum(p.numel() for p in read) * itemsize
    assert decode_bytes_per_step(engine, 1, 0) == weights
    assert decode_bytes_per_step(engine, 4, 100) == weights + 4 * 100 * per_token
