"""Engine configuration: frozen dataclasses, validated once at start-up.

Each component receives only the piece it needs (the runner a ``CacheConfig``, the scheduler a
``SchedulerConfig``); ``EngineConfig`` only groups them for the CLI and the offline API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve import envs

if TYPE_CHECKING:
    import torch

# dtype name (or alias) -> torch's name for it. torch is imported where a dtype is made, not here:
# the CLI reads these defaults for every command, and the gateway never needs torch.
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def __getattr__(name: str):
    if name == "DTYPES":  # name -> torch.dtype, as DTYPE_NAMES, for the engine's side
        return {alias: _dtype(alias) for alias in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and the kernels are
    built to use it (``PDSERVE_CPU_ISA`` native); elsewhere bf16 is emulated."""
    if envs.cpu_isa() != "native":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """ "auto" means bf16 where the hardware computes it natively (CUDA, AVX512-BF16/AMX CPUs), else fp32.

    Measured on a 2-core Zen 3 (AVX2 only): bf16 linear layers at 32 tokens were 4x slower than fp32.
    """
    if name == "auto":
        return _dtype(
            "bfloat16" if device.startswith("cuda") or cpu_has_native_bf16() else "float32"
        )
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"dtype {name!r} is not supported; use one of: auto, {', '.join(DTYPE_NAMES)}"
        )
    return _dtype(name)


# The KV cache's element type (``--kv-cache-dtype``): "auto" is the activation dtype, except under
# an fp32 model with quantized projections on the CPU (the fast path of CPUs without native bf16),
# which keeps bf16 pools as llama.cpp keeps f16 ones; bf16 pools under an fp32 model halve the bytes
# a decode step reads of the KV cache and double the blocks a budget holds (the attention reads
# them into fp32). Aliases as for ``DTYPES``.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, device: str, quantization: str = "none"
) -> torch.dtype:
    """The KV pools' dtype for ``--kv-cache-dtype name`` under a model computing in ``dtype`` on
    ``device`` with its projections held as ``quantization`` (resolved: not "auto"). "auto":
    ``dtype``, or bf16 for an fp32 model with quantized projections on the CPU. Besides that,
    only bf16 pools under fp32 activations on the CPU: on CUDA the Triton kernels take one dtype
    (rope/write falls back to torch, prefill attention does not mix them), and no kernel reads
    fp32 pools with bf16 queries fast (refused rather than run on the reference path).
    ValueError otherwise, saying what is allowed."""
    import torch

    cpu = torch.device(device).type == "cpu"
    if name == "auto":
        quantized = quantization not in ("none", "auto")
        return torch.bfloat16 if dtype == torch.float32 and cpu and quantized else dtype
    if name not in DTYPE_NAMES:
        raise _unsupported_kv_cache_dtype(name)
    kv = _dtype(name)
    if kv == dtype:
        return kv
    names = f"a {_name(kv)} KV cache with {_name(dtype)} activations"
    if not cpu:
        raise ValueError(
            f"{names} is not supported on {device}: on CUDA the KV cache has the activation dtype "
            "(use kv_cache_dtype auto, or --dtype bfloat16)"
        )
    if kv != torch.bfloat16 or dtype != torch.float32:
        raise ValueError(
            f"{names} is not supported: a KV cache of another dtype than the activations' is "
            "bfloat16 under float32 activations only (use kv_cache_dtype auto)"
        )
    return kv


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unsupported_kv_cache_dtype(name: str) -> ValueError:
    return ValueError(
        f"kv_cache_dtype {name!r} is not supported; use one of: {', '.join(KV_CACHE_DTYPES)} "
        "(or bf16, fp32)"
    )


# How the projection weights are held (``--quantization``): "none" (dense, in the dtype), "gguf"
# (a GGUF model's own Q4_0/Q4_1/Q8_0 blocks, as the file has them), or quantized at load: "int8"
# (per output channel, symmetric), "q8_0", "q4_1", "q4_0" (GGUF's block formats). "auto" (the
# default): "gguf" for a model converted from a GGUF file whose weights would be fp32 on the CPU
# (no native bf16: 4-bit blocks read 5x fewer bytes a token than fp32), else "none"
# (model/quantize.py: resolve_quantization).
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "q8_0", "q4_1", "q4_0")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``block_size`` tokens per block; pool size from bytes or a memory fraction.
    ``resident``: a CPU pool's memory is mapped when the engine starts (kernels/cpu/memory.py:
    a page first written under a request cost a fault and its zeroing there, and memory that is
    not there fails the start, not a request); False leaves it to the blocks' first writes."""

    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.1
    enable_prefix_caching: bool = True
    resident: bool = True
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES (or bf16, fp32): resolve_kv_cache_dtype

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two from 1 to 128, got {self.block_size}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPE_NAMES:
            raise _unsupported_kv_cache_dtype(self.kv_cache_dtype)


# The order prompts are computed in (scheduler.py): "shortest" first (the fewest tokens left to
# compute, a waiting prompt aged by PROMPT_AGING), or "arrival" (first come, first served)
PROMPT_ORDERS = ("shortest", "arrival")
# "shortest": a prompt is passed over by later, shorter ones for at most about this many times
# its own compute time; after that it goes before any prompt that arrives (gateways size KV holds
# with it: cost.kv_hold_s)
PROMPT_AGING = 4.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: at most ``max_num_seqs`` running, ``max_num_batched_tokens`` per
    forward, prompts computed in ``prompt_order`` (PROMPT_ORDERS)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    prompt_order: str = "shortest"

    def __post_init__(self) -> None:
        if self.prompt_order not in PROMPT_ORDERS:
            raise ValueError(
                f"prompt order {self.prompt_order!r} is not one of {', '.join(PROMPT_ORDERS)}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def from_args(cls, args) -> SchedulerConfig:
        """From the engine's command-line options (``pdserve.cli._engine_args``)."""
        return cls(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prompt_order=args.prompt_order,
        )


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads; None: all cores of the machine
    seed: int = 0
    quantization: str = "auto"  # QUANTIZATIONS
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype {self.dtype!r} is not supported; use one of: auto, {', '.join(DTYPE_NAMES)}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; use one of: {', '.join(QUANTIZATIONS)}"
            )
        if self.quantization not in ("none", "auto") and self.device != "cpu":
            raise ValueError("quantized weights run on the CPU only; use --quantization none")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.cache.kv_cache_dtype != "auto":
            self.kv_torch_dtype  # noqa: B018 - ValueError now for a combination refused

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    @property
    def kv_torch_dtype(self) -> torch.dtype | None:
        """The KV pools' dtype (``cache.kv_cache_dtype`` resolved against ``torch_dtype``); None
        for "auto", which the runner resolves once the model's weights are loaded (it depends on
        whether they are quantized)."""
        if self.cache.kv_cache_dtype == "auto":
            return None
        return resolve_kv_cache_dtype(self.cache.kv_cache_dtype, self.torch_dtype, self.device)
