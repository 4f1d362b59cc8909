"""``bench_gpu.launches_per_step`` (what `pdserve bench offline --device cuda` prints as the GPU
work per decode step) leaves the engine as it found it: its request aborted, every block free.
On the CPU the profiler sees no CUDA activity, so it reports nothing; on a GPU, kernels. So does
``bench_offline.host_profile`` (`--host-profile`: the host's time in decode steps by function)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.bench_gpu import launches_per_step
from pdserve.bench_offline import host_profile
from pdserve.config import CacheConfig
from tests.gpu import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_launch_count_leaves_no_request_behind(tiny_model, device):
    folder, _ = tiny_model("gqa_untied")
    llm = LLM(str(folder), device=device, cache=CacheConfig(block_size=4, kv_cache_bytes=1 << 22))
    engine = llm.engine
    counted = launches_per_step(engine, list(range(3, 40)))
    if device == "cpu" or not torch.cuda.is_available():
        assert counted == {}
    else:
        assert counted["kernels"] > 0
        assert 0 < counted["busy_ms"] and counted["top"][0]["ms"] <= counted["busy_ms"]
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.allocator.num_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_host_profile_names_the_steps_functions_and_leaves_no_request_behind(tiny_model, device):
    folder, _ = tiny_model("gqa_untied")
    llm = LLM(str(folder), device=device, cache=CacheConfig(block_size=4, kv_cache_bytes=1 << 22))
    report = host_profile(llm, batch=3, prompt_len=9, steps=8, top=1000)  # every function
    assert report.startswith("host profile of 8 decode steps at batch 3:")
    # cProfile's rows, by function (on an H200 the engine's own step was not among them, the
    # scheduler's was: a row the step always calls)
    assert "scheduler.py" in report and "(schedule)" in report
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.allocator.num_blocks
