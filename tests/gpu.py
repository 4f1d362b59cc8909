"""The marks of tests that need a CUDA GPU: ``pytest -m gpu`` selects them (scripts/gpu-check
runs them all), and without CUDA they skip with the reason ``NO_CUDA``."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU"
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
GPU = [pytest.mark.gpu, NEEDS_CUDA]  # a parameter's marks; a test function takes both
# The devices an engine or a transport test runs on: the CPU everywhere, CUDA where present.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=GPU)]
# (sender, receiver) devices of a KV transfer: each way that involves GPU memory, and the CPU
# pair, which runs everywhere and so proves the test itself.
DEVICE_PAIRS = [
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cuda", "cuda", id="gpu-gpu", marks=GPU),
    pytest.param("cuda", "cpu", id="gpu-cpu", marks=GPU),
    pytest.param("cpu", "cuda", id="cpu-gpu", marks=GPU),
]
