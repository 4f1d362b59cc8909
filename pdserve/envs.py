"""Every environment variable pdserve reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models and compiled CPU kernels live (PDSERVE_CACHE_DIR, else ~/.cache/pdserve)."""
    root = os.environ.get("PDSERVE_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve"


def kernel_backend() -> str | None:
    """Force a kernel backend ("reference", "cpu", "triton"); None lets the launcher choose."""
    return os.environ.get("PDSERVE_KERNEL_BACKEND") or None


def layer_loop_enabled() -> bool:
    """Whether a backend's flat layer loop may replace the module path
    (PDSERVE_LAYER_LOOP=0 turns it off, to compare the two)."""
    return os.environ.get("PDSERVE_LAYER_LOOP", "1") != "0"


def cuda_graphs() -> bool:
    """Whether decode-only steps on CUDA replay CUDA graphs (pdserve/decode_graphs.py; on since an
    H100 run proved them: the eager steps' tokens, 1.9x faster steps; PDSERVE_CUDA_GRAPHS=0 off)."""
    return os.environ.get("PDSERVE_CUDA_GRAPHS", "1") != "0"


def decode_splits() -> int | None:
    """A fixed number of programs per (sequence, kv head) for the Triton decode attention
    (PDSERVE_DECODE_SPLITS; 1 is one program walking the whole context); None: by the batch."""
    value = os.environ.get("PDSERVE_DECODE_SPLITS")
    return int(value) if value else None


CPU_ISAS = ("native", "avx2", "portable")


def cpu_isa() -> str:
    """The instruction set every C kernel is built for (PDSERVE_CPU_ISA): "native" (default:
    everything this CPU has), "avx2" (no AVX-512, as on an AVX2 + FMA machine; bf16 then counts as
    emulated) or "portable" (no AVX). Lets an AVX-512 machine run and test the paths an AVX2
    machine takes; for a faithful run also set torch's ATEN_CPU_CAPABILITY=avx2."""
    isa = os.environ.get("PDSERVE_CPU_ISA") or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"PDSERVE_CPU_ISA={isa!r}; use one of {', '.join(CPU_ISAS)}")
    return isa


def quant_isa() -> str:
    """Which build of the quantized-weight kernels the CPU backend uses (PDSERVE_QUANT_ISA):
    "native" (AVX-512 where the CPU has it, else AVX2), "avx2" or "portable"; default: the
    PDSERVE_CPU_ISA one (a build is never wider than PDSERVE_CPU_ISA allows)."""
    return os.environ.get("PDSERVE_QUANT_ISA") or cpu_isa()


def quant_integer() -> bool:
    """Whether Q4_1 and Q8_0 weights take quant.c's integer path where the build has it
    (PDSERVE_QUANT_INTEGER, default 1; 0 keeps the float path, e.g. to compare the two)."""
    return os.environ.get("PDSERVE_QUANT_INTEGER", "1") != "0"


def otlp_endpoint() -> str | None:
    """The standard OpenTelemetry exporter endpoint (OTEL_EXPORTER_OTLP_ENDPOINT); None: tracing off."""
    return os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def api_keys() -> str | None:
    """The gateway's API keys as the JSON of a key file (PDSERVE_API_KEYS: hashed keys and
    limits, as ``pdserve keys add`` writes them), used when no --api-keys file is given."""
    return os.environ.get("PDSERVE_API_KEYS") or None


CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"


def cluster_token() -> str | None:
    """The secret workers present when they register with the gateway (PDSERVE_CLUSTER_TOKEN;
    unset or empty: none). An environment variable rather than a flag, so that it stays out of
    the process list."""
    return os.environ.get(CLUSTER_TOKEN_ENV) or None
