"""Decode steps from CUDA graphs (pdserve/decode_graphs.py), everything but the graph itself:
on the CPU the Triton kernels run under the interpreter and ``EagerGraph`` stands in for a CUDA
graph (replays run the captured function again on the same static tensors, into the same
output). Requests finishing at different steps move the batch through buckets 4, 2 and 1 with
padding rows, which must neither change the real rows' tokens nor write KV anywhere. On a GPU
(``gpu``) the real CUDA graphs are captured and replayed."""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.decode_graphs import DecodeGraphs, EagerGraph
from tests.engine.test_tiny_vs_hf import PROMPTS
from tests.gpu import DEVICES, HAS_CUDA
from tests.kernels.test_kernels_backends import load_backend


def run(folder, device: str, graphs: str):
    """``graphs``: "off" (eager steps), "lazy" (each batch size captured at its first step) or
    "all" (every batch size captured before the first request, as the engine does on CUDA)."""
    llm = LLM(
        str(folder),
        device=device,
        cache=CacheConfig(block_size=4, kv_cache_bytes=1 << 22),
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    runner = llm.engine.runner
    if device == "cuda":  # the engine captured every batch size's graph when it started
        assert sorted(runner.graphs.graphs) == runner.graphs.buckets == [1, 2, 4, 8]
    runner.graphs = None
    if graphs != "off":
        runner.graphs = DecodeGraphs(
            runner.model,
            runner.pool.kv_caches,
            llm.engine.scheduler.config.max_num_seqs,
            64,
            torch.device(device),
            graph_factory=EagerGraph if device == "cpu" else None,
        )
        if graphs == "all":
            runner.graphs.capture_all()
            assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
    # 4, 10, 17 and 24 new tokens: the batch shrinks from 4 rows to 1
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3)
        for n in (4, 10, 17, 24)
    ]
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.num_free_blocks == llm.engine.allocator.num_blocks
    return outs, runner.graphs


@functools.cache
def _eager(folder: str, device: str):
    """The eager steps' outputs, once per model and device: both tests compare with them (under
    the Triton interpreter each run takes ~20 s on a 2-core Zen 3)."""
    return run(folder, device, "off")[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["lazy", "all"])
def test_graph_steps_give_the_eager_steps_tokens(tiny_model, device, when, monkeypatch):
    if device == "cpu":
        if HAS_CUDA:
            pytest.skip("kernels.triton runs compiled for the GPU here")
        load_backend("triton", "cpu")  # skips unless the interpreter runs kernels.triton
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    folder, _ = tiny_model("gqa_untied")
    eager = _eager(str(folder), device)
    replayed, graphs = run(folder, device, when)
    captured = sorted(b for b, made in graphs.graphs.items() if made is not None)
    assert captured == ([1, 2, 4] if when == "lazy" else [1, 2, 4, 8])
    for want, got in zip(eager, replayed, strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert torch.allclose(
                torch.tensor([v for _, v in a.top]), torch.tensor([v for _, v in b.top]), atol=1e-4
            )
    # rows past the last step's are padding, and a capture after steps (here batch size 8's,
    # which no step used) writes no KV: its rows are padding again first (a finished sequence's
    # slot may belong to another request by then)
    last = graphs._last_rows
    assert bool((graphs.slots[last:] == -1).all()) and bool((graphs.context_lens[last:] == 0).all())
    if when == "lazy":
        pools = [t.clone() for kv in graphs.kv_caches for t in kv]
        graphs.ids[:last] += 1  # what a stale row would write differs from what is there
        assert graphs._graph(8) is not None
        after = [t for kv in graphs.kv_caches for t in kv]
        # compared as bytes: a block never written holds whatever the memory held, NaNs included
        assert all(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            for a, b in zip(pools, after, strict=True)
        )
