"""The CUDA backend's kernels (Triton) driving the whole engine, on the CPU under the Triton
interpreter: the tiny models' greedy tokens and logprobs against transformers, as on a GPU
(test_tiny_vs_hf.py), so the CUDA path's wiring (fused ops rotating and normalising in place,
KV written where attention reads it) is checked on every machine, not only where a GPU is lent."""

from __future__ import annotations

import pytest

from tests.engine import test_tiny_vs_hf
from tests.gpu import HAS_CUDA
from tests.kernels.test_kernels_backends import load_backend


@pytest.mark.skipif(HAS_CUDA, reason="kernels.triton runs compiled for the GPU here (gpu tests)")
@pytest.mark.parametrize("kind", ["gqa_untied", "qwen2_qkv_bias", "llama3_rope_scaling"])
def test_triton_kernels_in_the_engine_match_transformers(tiny_model, kind, monkeypatch):
    load_backend("triton", "cpu")  # skips unless the interpreter runs kernels.triton
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    test_tiny_vs_hf.test_greedy_tokens_and_logprobs_match_transformers(tiny_model, kind, "cpu")
