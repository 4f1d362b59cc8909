"""pdserve/roofline.py: the roofline arithmetic on known numbers, the counts a step's batch gives,
the model's costs against the real model's tensors, and the measurement's time and bad input."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve import roofline
from pdserve.config import CacheConfig
from pdserve.kv_cache.pool import bytes_per_block
from pdserve.llm import LLM
from pdserve.roofline import MachineRates, ModelCost, Roofline, StepWork
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import ScheduledBatch
from pdserve.sequence import Sequence

# weights 1 MB; 100 k layer params; 50 k lm_head params; 1 kB of KV a token; 400 flop a pair
COST = ModelCost(1_000_000, 100_000, 50_000, 1_000, 400)
RATES = MachineRates(bandwidth=1e9, gemm_flops=1e10)


def test_a_decode_step_is_bound_by_its_bytes():
    # batch 2 at 100 and 300 tokens of context
    work = StepWork(num_tokens=2, num_sampled=2, num_kv_tokens_read=400, num_attention_pairs=400)
    r = Roofline(COST, RATES)
    assert r.bytes(work) == 1_000_000 + 400 * 1_000
    assert r.flops(work) == 2 * 100_000 * 2 + 2 * 50_000 * 2 + 400 * 400
    # 1.4 MB at 1 GB/s = 1.4 ms; 0.76 Mflop at 10 Gflop/s = 0.076 ms
    assert r.seconds(work) == pytest.approx(1.4e-3)
    assert r.fraction(work, 2.8e-3) == pytest.approx(0.5)


def test_steps_of_more_rows_than_the_blocks_serve_read_the_copies():
    """A bf16 model's GGUF blocks are read by steps of up to 8 tokens, their packed copies by
    larger ones, but a Q4_1 weight's blocks by any number of a generated token's rows (its tier
    counts prompt tokens only): the roofline counts what each step reads."""
    tiers = ((8, 500_000, False), (8, 1_500_000, True))
    cost = ModelCost(1_000_000, 100_000, 50_000, 1_000, 400, weight_tiers=tiers)
    r = Roofline(cost, RATES)
    cases = (  # tokens, of them a prompt's, weights read
        (1, 0, 1_000_000),
        (8, 8, 1_000_000),
        (32, 0, 1_500_000),
        (32, 9, 3_000_000),
        (512, None, 3_000_000),
    )
    for tokens, prompt, weights in cases:
        work = StepWork(tokens, tokens, 100, 100, num_prompt_tokens=prompt)
        assert r.bytes(work) == weights + 100 * 1_000
        assert r.kv_bytes(work) == 100 * 1_000
    work = StepWork(9, 9, 0, 0)
    assert Roofline(COST, RATES).bytes(work) == 1_000_000  # no tiers: the same at any count


def test_a_prompt_chunk_is_bound_by_its_flops():
    # 1,000 tokens from position 0, the last one sampled
    pairs = 1000 * 1001 // 2
    work = StepWork(
        num_tokens=1000, num_sampled=1, num_kv_tokens_read=1000, num_attention_pairs=pairs
    )
    r = Roofline(COST, RATES)
    flops = 2 * 100_000 * 1000 + 2 * 50_000 + 400 * pairs
    assert r.flops(work) == flops == 400_300_000
    assert r.bytes(work) == 2_000_000  # 2 ms at 1 GB/s, less than 40 ms of flops
    assert r.seconds(work) == pytest.approx(flops / 1e10)
    assert r.fraction(work, 0.1) == pytest.approx(0.4003)


def _seq(num_prompt: int, num_computed: int, num_output: int = 0) -> Sequence:
    seq = Sequence("r", list(range(num_prompt)), SamplingParams(max_tokens=8))
    seq.num_computed_tokens = num_computed
    seq.output_token_ids = list(range(num_output))
    return seq


def test_step_work_counts_tokens_samples_kv_and_attention_pairs():
    batch = ScheduledBatch(
        prefills=[(_seq(24, 16), 8), (_seq(100, 0), 10)],  # the first one finishes its prompt
        decodes=[_seq(5, 7, 3), _seq(40, 44, 5)],  # 8 and 45 tokens of context
    )
    w = StepWork.of(batch)
    assert w.num_tokens == 8 + 10 + 2
    assert w.num_prompt_tokens == 8 + 10
    assert w.num_sampled == 1 + 2
    assert w.num_kv_tokens_read == 24 + 10 + 8 + 45
    # queries 16..23 over keys 0..p: 17 + ... + 24; queries 0..9: 1 + ... + 10; decodes: 8, 45
    assert w.num_attention_pairs == sum(range(17, 25)) + sum(range(1, 11)) + 8 + 45


def test_the_model_cost_counts_the_models_own_tensors(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    llm = LLM(str(folder), dtype="float32", threads=1, cache=CacheConfig(kv_cache_bytes=1 << 20))
    engine = llm.engine
    model = engine.runner.model
    cost = roofline.for_engine(engine, RATES).cost
    layers = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert cost.layer_params == layers
    assert cost.lm_head_params == model.lm_head.weight.numel()
    assert cost.weight_bytes == engine.runner.weight_bytes()
    cfg = engine.model_config
    assert cost.kv_bytes_per_token == bytes_per_block(cfg, 16, torch.float32) // 16
    assert cost.attention_flops_per_pair == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    # the engine counts each step's batch as it runs it: the last one decodes the one sequence
    prompt = [5, 6, 7, 8, 9]
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.last_step == StepWork(1, 1, len(prompt) + 3, len(prompt) + 3, 0)


def test_the_bandwidth_buffer_is_twice_the_llc_within_bounds():
    mib = 1 << 20
    assert roofline.bandwidth_buffer_bytes(0) == 256 * mib
    assert roofline.bandwidth_buffer_bytes(260 * mib) == 520 * mib
    assert roofline.bandwidth_buffer_bytes(2048 * mib) == 1024 * mib


def test_measuring_takes_seconds_not_minutes():
    torch.set_num_threads(1)
    start, cpu_start = time.perf_counter(), time.process_time()
    rates = roofline.measure("cpu", torch.float32)
    took, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    # CPU seconds (user + system, page faults included): what the measurement costs a worker's
    # start; its wall time is that on an idle core (0.5-0.7 s here) and grows with the load
    # on a shared machine (tests running beside it)
    assert cpu < 3.0, f"measuring took {cpu:.2f} s of CPU ({took:.2f} s of wall time)"
    assert rates.seconds <= took
    # a CPU core streams from 1 GB/s to a few hundred; it multiplies at 1 to 10,000 Gflop/s
    assert 1e9 < rates.bandwidth < 1e12
    assert 1e9 < rates.gemm_flops < 1e13
    assert rates.gemm_flops == max(rates.gemm_rates.values())
    assert set(rates.gemm_rates) == {
        "linear_none_decode",
        "linear_none_prefill",
        "torch_dense_prefill",
    }


def test_bad_input_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="bandwidth must be a positive, finite rate"):
        MachineRates(bandwidth=0.0, gemm_flops=1.0)
    with pytest.raises(ValueError, match="gemm_flops must be a positive, finite rate"):
        MachineRates(bandwidth=1.0, gemm_flops=float("nan"))
    work = StepWork(1, 1, 1, 1)
    with pytest.raises(ValueError, match="measured time must be positive"):
        Roofline(COST, RATES).fraction(work, 0.0)
    with pytest.raises(ValueError, match="'q3_k' is not one of: none, q4_0"):
        roofline.measure_gemm(torch.device("cpu"), torch.float32, "q3_k")
    with pytest.raises(ValueError, match="at least 1 MiB"):
        roofline.measure_bandwidth(torch.device("cpu"), 4096)


def test_best_of_two_measurements_takes_each_rate_at_its_higher():
    a = MachineRates(bandwidth=10e9, gemm_flops=100e9, seconds=0.5, gemm_rates={"x": 100e9})
    b = MachineRates(bandwidth=14e9, gemm_flops=90e9, seconds=0.6, gemm_rates={"x": 90e9})
    both = roofline.best(a, b)
    assert (both.bandwidth, both.gemm_flops, both.gemm_rates) == (14e9, 100e9, {"x": 100e9})
    assert both.seconds == pytest.approx(1.1)


def test_the_offline_bench_reports_the_median_steps_fraction_and_bytes():
    from pdserve.bench_offline import roofline_summary

    r = Roofline(COST, RATES)  # weights 1 MB at 1 GB/s: 1 ms + 1 us per KV token
    steps = [(StepWork(1, 1, n, n), s) for n, s in ((100, 2.2e-3), (200, 1.2e-3), (300, 4.3e-3))]
    got = roofline_summary(r, steps)
    # fractions 1.1/2.2, 1.2/1.2, 1.3/4.3 ms: the median is 0.5
    assert got["roofline_fraction"] == pytest.approx(0.5)
    assert got["roofline_bytes"] == 1_000_000 + 200 * 1_000
    assert got["roofline_kv_bytes"] == 200 * 1_000
    assert got["roofline_ms"] == pytest.approx(1.2)
    assert roofline_summary(r, []) == {}
