"""MBU as ``pdserve bench offline --device cuda`` reports it (pdserve/bench_gpu.py): each step's
bytes (the roofline's: weights + the KV it reads) over its time and the device's bandwidth, the
median over steps. The bandwidth itself needs a GPU (scripts/gpu-check runs the benchmark)."""

from __future__ import annotations

import pytest

from pdserve.bench_gpu import mbu
from pdserve.roofline import MachineRates, ModelCost, Roofline, StepWork

COST = ModelCost(
    weight_bytes=1000,
    layer_params=1,
    lm_head_params=1,
    kv_bytes_per_token=10,
    attention_flops_per_pair=1,
)
ROOFLINE = Roofline(COST, MachineRates(bandwidth=1.0, gemm_flops=1.0))


def step(kv_tokens: int) -> StepWork:
    return StepWork(
        num_tokens=1, num_sampled=1, num_kv_tokens_read=kv_tokens, num_attention_pairs=1
    )


def test_mbu_is_the_median_steps_bytes_over_time_and_bandwidth():
    # 1000 + 10 x 100 = 2000 bytes in 1 ms, 2500 bytes in 2 ms, 3000 bytes in 1 ms, at 4 MB/s:
    # 0.5, 0.3125 and 0.75 of it; the median is 0.5
    steps = [(step(100), 1e-3), (step(150), 2e-3), (step(200), 1e-3)]
    assert mbu(ROOFLINE, steps, bandwidth=4e6) == pytest.approx(0.5)


def test_no_steps_is_zero():
    assert mbu(ROOFLINE, [], bandwidth=4e6) == 0.0
