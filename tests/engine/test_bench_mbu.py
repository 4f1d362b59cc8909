"""MBU as ``pdserve bench offline --device cuda`` reports it (pdserve/bench_gpu.py): each step's
bytes (the roofline's: weights + the KV it reads) over its time and the device's bandwidth, the
median over steps. The bandwidth itself needs a GPU (scripts/gpu-check runs the benchmark)."""

from __future__ import annotations

import pytest

from pdserve.bench_gpu import mbu
from pdserve.roofline import Roofline, StepWork
from tests.engine.test_roofline import COST, RATES

ROOFLINE = Roofline(COST, RATES)  # 1 MB of weights, 1 kB of KV per token


def step(kv_tokens: int) -> StepWork:
    return StepWork(
        num_tokens=1, num_sampled=1, num_kv_tokens_read=kv_tokens, num_attention_pairs=1
    )


def test_mbu_is_the_median_steps_bytes_over_time_and_bandwidth():
    # 1 MB + 1000 x 1 kB = 2 MB in 1 ms, 2.5 MB in 2 ms, 3 MB in 1 ms, at 4 GB/s: 0.5, 0.3125
    # and 0.75 of it; the median is 0.5
    steps = [(step(1000), 1e-3), (step(1500), 2e-3), (step(2000), 1e-3)]
    assert mbu(ROOFLINE, steps, bandwidth=4e9) == pytest.approx(0.5)


def test_no_steps_is_zero():
    assert mbu(ROOFLINE, [], bandwidth=4e9) == 0.0
