"""``PDSERVE_CPU_ISA``: every C kernel built as a narrower machine builds it, so that an AVX-512
machine runs, and tests, the code an AVX2 machine runs.

- The switch: with "avx2" no library holds an AVX-512 path (decode attention, quant.c) and bf16
  counts as emulated; without it an AVX-512 machine's libraries do.
- The default model's reference tests pass on the AVX2 build, run in a child pytest with the switch
  (and torch's ATEN_CPU_CAPABILITY=avx2) set: greedy tokens against transformers (dense fp32:
  linear.c's AVX2 tiles, the fp32 layer loop, decode attention's non-AVX-512 path) and the GGUF's
  Q4_1 blocks against the same weights dequantized (quant.c's AVX2 integer path). Where the CPU has
  no AVX-512 these tests already run that code: skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.kernels.cpu import build, ops, quant

from pdserve import config, envs
from tests.kernels.test_quant import FLAGS  # the CPU's own flags, whatever the switch

ROOT = Path(__file__).resolve().parents[2]
HAS_AVX512 = {"avx2", "fma", "avx512f", "avx512bw"} <= FLAGS
needs_avx512 = pytest.mark.skipif(
    not HAS_AVX512, reason="no AVX-512 here: the native build is the AVX2 one"
)
REFERENCE_TESTS = (
    "tests/engine/test_default_model.py::test_greedy_matches_transformers_on_8_prompts[cpu]",
    "tests/engine/test_quantized_model.py::test_native_q4_1_greedy_equals_dequantized_fp32",
)


@needs_avx512
def test_avx2_builds_hold_no_avx512_path(monkeypatch):
    monkeypatch.delenv("PDSERVE_CPU_ISA", raising=False)
    monkeypatch.delenv("PDSERVE_QUANT_ISA", raising=False)
    native = ops.declare_attention(build.load_library(ops._SOURCE))
    assert native.pdserve_paged_attention_f32_512() == 1
    assert quant.isa_of(quant.load(quant._SOURCE, envs.quant_isa())) == "avx512"
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    attention = ops.declare_attention(build.load_library(ops._SOURCE))
    assert attention.pdserve_paged_attention_f32_512() == 0
    assert quant.isa_of(quant.load(quant._SOURCE, envs.quant_isa())) == "avx2"
    # an explicit build is never wider than the switch allows
    assert quant.isa_of(quant.load(quant._SOURCE, "native")) == "avx2"
    assert not config.cpu_has_native_bf16()
    assert config.resolve_dtype("auto", "cpu") is config.DTYPES["float32"]


def test_an_unknown_isa_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx3")
    with pytest.raises(
        ValueError, match=r"PDSERVE_CPU_ISA='avx3'; use one of native, avx2, portable"
    ):
        build.load_library(ops._SOURCE)


@needs_avx512
def test_the_avx2_build_passes_the_default_models_reference_tests():
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    env.pop("PDSERVE_QUANT_ISA", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *REFERENCE_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert f"{len(REFERENCE_TESTS)} passed" in proc.stdout, tail  # ran, none skipped
