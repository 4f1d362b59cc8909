"""Roofline self-report: how close each engine step runs to what this machine can do.

At start a worker measures two rates, with the torch thread count its engine uses (``measure``:
about half a second on an idle core, most of it the first touch of the buffer):

- **memory bandwidth** (bytes/s): the best of a few full reads of a buffer much larger than the
  last-level cache (``bandwidth_buffer_bytes``: twice the LLC, 256 MiB to 1 GiB), by a reduction
  and by a matrix-vector product, as a decode step reads its weights: once, front to back;
- **GEMM rate** (flop/s): the best of the engine's own ``linear`` on a weight in the engine's
  format (dense in its dtype, or quantized the same way) at a decode-like (16 rows) and a
  prefill-like (256 rows) shape, and torch's dense matmul in the dtype at the prefill shape.
  The ceiling is the best of them: where the engine's kernel is slower than torch's, the
  fraction shows it.

Each step's **roofline time** is the least time the step could take on this machine:

    roofline = max(bytes / bandwidth, flops / gemm rate)
    bytes    = weight bytes (as stored: quantized or dense, lm_head included, each once)
               + KV bytes read (every context token of every sequence in the batch, K and V)
    flops    = 2 x decoder-layer params x tokens + 2 x lm_head params x sampled rows
               + 4 x heads x head_dim x layers per (query, key) pair of attention
    fraction = roofline / measured step time

1.0 is the limit. A model whose weights fit in the cache can pass it (the bandwidth is
measured from memory, not from the cache); KV written, activations and the last layer's
pruning of rows nobody samples (1/num_layers of the layer flops) are left out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.model.config import ModelConfig

if TYPE_CHECKING:
    from pdserve.engine import LLMEngine
    from pdserve.scheduler import ScheduledBatch

MIN_BUFFER_BYTES = 256 << 20
MAX_BUFFER_BYTES = 1 << 30
GEMM_SHAPE = (1024, 1024)  # [N, K] of the weight the GEMM rate is measured on
GEMM_ROWS = {"decode": 16, "prefill": 256}
REPEATS = 3  # best of: a pass that another process's time slice fell into does not count


@dataclass(frozen=True)
class MachineRates:
    """What ``measure`` found: ``bandwidth`` bytes/s, ``gemm_flops`` flop/s (the best of
    ``gemm_rates``, flop/s by kernel and shape); ``seconds`` it took; the buffer it read."""

    bandwidth: float
    gemm_flops: float
    seconds: float = 0.0
    buffer_bytes: int = 0
    gemm_rates: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("bandwidth", "gemm_flops"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive, finite rate; got {value!r}")


@dataclass(frozen=True)
class ModelCost:
    """What a step of this model reads and computes, per unit of work (``StepWork``)."""

    weight_bytes: int  # every weight once, as stored
    layer_params: int  # multiplied by every token, all decoder layers
    lm_head_params: int  # multiplied by every sampled row
    kv_bytes_per_token: int  # K and V of one token, all layers
    attention_flops_per_pair: int  # one query against one key (QK^T and PV), all layers
    # (rows, extra, prompt_only): steps of more than rows tokens (prompt_only: prompt tokens)
    # read extra bytes more (none: the same at every row count). A bf16 model's GGUF blocks are
    # read by small steps, their packed bf16 copies by larger ones (kernels/cpu/gemm.py's hybrid:
    # past 8 rows), but a Q4_1 weight's blocks by a generated token's rows at any count
    # (prompt_only). Decided by the step's token count for the lm_head too (its rows are the
    # sampled ones, fewer in a prefill step: compute bound).
    weight_tiers: tuple[tuple[int, int, bool], ...] = ()

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        weight_bytes: int,
        kv_itemsize: int,
        weight_tiers: tuple[tuple[int, int, bool], ...] = (),
    ) -> ModelCost:
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size  # qkv, o
        per_layer += 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
        return cls(
            weight_bytes=weight_bytes,
            layer_params=cfg.num_layers * per_layer,
            lm_head_params=cfg.hidden_size * cfg.vocab_size,
            kv_bytes_per_token=2 * cfg.num_layers * kv * kv_itemsize,
            attention_flops_per_pair=4 * cfg.num_layers * q,
            weight_tiers=weight_tiers,
        )

    def weights_read(self, num_tokens: int, num_prompt_tokens: int | None = None) -> int:
        """Bytes of weights a step of ``num_tokens`` tokens (``num_prompt_tokens`` of them a
        prompt's; None: all) reads."""
        prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        return self.weight_bytes + sum(
            extra
            for rows, extra, prompt_only in self.weight_tiers
            if (prompt if prompt_only else num_tokens) > rows
        )


@dataclass(frozen=True)
class StepWork:
    """One step's batch, counted: tokens run, rows sampled, KV tokens read, attention pairs, and
    of the tokens those of prompts (None: not counted, all)."""

    num_tokens: int
    num_sampled: int
    num_kv_tokens_read: int
    num_attention_pairs: int
    num_prompt_tokens: int | None = None

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepWork:
        """Counted before the step runs (it moves the sequences' computed counts on).

        A prompt chunk of n tokens from position s: queries s..s+n-1, each attending to every
        key up to itself, so sum(p + 1) = n*s + n(n+1)/2 pairs; it reads s+n tokens of KV. A
        decoding sequence of L tokens: one query over L keys."""
        tokens = sampled = kv = pairs = 0
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            tokens += n
            sampled += start + n == seq.num_prompt_tokens
            kv += start + n
            pairs += n * start + n * (n + 1) // 2
        prompt = tokens
        for seq in batch.decodes:
            tokens += 1
            sampled += 1
            kv += seq.num_tokens
            pairs += seq.num_tokens
        return cls(tokens, sampled, kv, pairs, prompt)


class Roofline:
    """A model's cost on a machine's rates: a step's least time, and how close a step came."""

    def __init__(self, cost: ModelCost, rates: MachineRates) -> None:
        self.cost = cost
        self.rates = rates

    def bytes(self, work: StepWork) -> int:
        return self.cost.weights_read(work.num_tokens, work.num_prompt_tokens) + self.kv_bytes(work)

    def kv_bytes(self, work: StepWork) -> int:
        return work.num_kv_tokens_read * self.cost.kv_bytes_per_token

    def flops(self, work: StepWork) -> int:
        c = self.cost
        return (
            2 * c.layer_params * work.num_tokens
            + 2 * c.lm_head_params * work.num_sampled
            + c.attention_flops_per_pair * work.num_attention_pairs
        )

    def seconds(self, work: StepWork) -> float:
        """The least time the step can take: its bytes at the bandwidth or its flops at the
        GEMM rate, whichever is longer."""
        return max(
            self.bytes(work) / self.rates.bandwidth, self.flops(work) / self.rates.gemm_flops
        )

    def fraction(self, work: StepWork, seconds: float) -> float:
        """Roofline time over the step's measured ``seconds`` (1: at the machine's limit)."""
        if not seconds > 0:
            raise ValueError(f"a step's measured time must be positive; got {seconds!r} s")
        return self.seconds(work) / seconds


def llc_bytes() -> int:
    """The last-level cache's size per sysfs (Linux), 0 when it cannot be read."""
    caches = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


def bandwidth_buffer_bytes(llc: int) -> int:
    """Twice the LLC, within 256 MiB .. 1 GiB: large enough that the reads come from memory."""
    return min(max(2 * llc, MIN_BUFFER_BYTES), MAX_BUFFER_BYTES)


def _best_seconds(fn: Callable[[], object], device: torch.device, warm_up: bool = True) -> float:
    """The fastest of ``REPEATS`` runs of ``fn`` (after one more, ``warm_up``); CUDA work is
    waited for."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    if warm_up:
        fn()
        sync(device)
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of the fastest full read of ``nbytes`` of memory (``REPEATS`` of each kind)."""
    if nbytes < 1 << 20:
        raise ValueError(f"the bandwidth buffer must be at least 1 MiB; got {nbytes} bytes")
    # Plain pages, as torch holds dense and quantized weights. Huge pages (the KV pool's) read
    # 5-10 % faster here, but their first touch took 1.9 s (the kernel compacting memory).
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    buf.fill_(1.0)  # touched: no page faults inside the timed reads
    # Two ways to stream it, the faster counts: a reduction, and a matrix-vector product (BLAS
    # prefetches: 5-7 % faster than sum() on one core here).
    rows = buf[: buf.numel() // 1024 * 1024].view(-1, 1024)
    ones = torch.ones(1024, dtype=torch.float32, device=device)
    seconds = min(  # no warm-up: the fill brought the pages in
        _best_seconds(buf.sum, device, warm_up=False),
        _best_seconds(lambda: torch.mv(rows, ones), device, warm_up=False),
    )
    return buf.numel() * 4 / seconds


def measure_gemm(
    device: torch.device, dtype: torch.dtype, weight_format: str = "none"
) -> dict[str, float]:
    """Flop/s by kernel and shape: the backend's ``linear`` on a ``GEMM_SHAPE`` weight in
    ``weight_format`` (``"none"``: dense in ``dtype``; else a ``kernels.QTYPES`` name) at each
    of ``GEMM_ROWS``, and torch's dense matmul at the prefill shape."""
    if weight_format != "none" and weight_format not in kernels.QTYPES:
        raise ValueError(
            f"weight format {weight_format!r} is not one of: none, {', '.join(kernels.QTYPES)}"
        )
    ops = kernels.get_backend(device)
    n, k = GEMM_SHAPE
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    if weight_format == "none":
        weight = dense
        prepack = getattr(ops, "prepack_linear", None)
        if prepack is not None:
            prepack(weight)
    else:
        weight = kernels.quantize(dense.float().cpu(), weight_format)
    rates: dict[str, float] = {}
    with torch.inference_mode():
        for shape, m in GEMM_ROWS.items():
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            seconds = _best_seconds(lambda x=x: ops.linear(x, weight), device)
            rates[f"linear_{weight_format}_{shape}"] = 2 * m * n * k / seconds
        m = GEMM_ROWS["prefill"]
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        seconds = _best_seconds(lambda: F.linear(x, dense), device)
        rates["torch_dense_prefill"] = 2 * m * n * k / seconds
    return rates


def measure(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weight_format: str = "none",
    buffer_bytes: int | None = None,
) -> MachineRates:
    """Both rates, with the torch thread count set now (set the engine's first)."""
    device = torch.device(device)
    start = time.perf_counter()
    nbytes = buffer_bytes if buffer_bytes is not None else bandwidth_buffer_bytes(llc_bytes())
    bandwidth = measure_bandwidth(device, nbytes)
    gemm = measure_gemm(device, dtype, weight_format)
    return MachineRates(
        bandwidth=bandwidth,
        gemm_flops=max(gemm.values()),
        seconds=time.perf_counter() - start,
        buffer_bytes=nbytes,
        gemm_rates=gemm,
    )


def weight_format(model: torch.nn.Module) -> str:
    """How the model's projections are held: "none" (dense) or the quantized format's name
    (that of the first layer's MLP, the largest projections)."""
    weight = model.layers[0].mlp.gate_up_proj.weight
    if isinstance(weight, kernels.QuantizedWeight):
        return next(name for name, code in kernels.QTYPES.items() if code == weight.qtype)
    return "none"


def best(a: MachineRates, b: MachineRates) -> MachineRates:
    """Each rate at the better of two measurements: another process's work only ever slows a
    measurement down, so on a shared machine the higher one is nearer the machine's limit."""
    return MachineRates(
        bandwidth=max(a.bandwidth, b.bandwidth),
        gemm_flops=max(a.gemm_flops, b.gemm_flops),
        seconds=a.seconds + b.seconds,
        buffer_bytes=max(a.buffer_bytes, b.buffer_bytes),
        gemm_rates={k: max(a.gemm_rates.get(k, 0.0), v) for k, v in b.gemm_rates.items()},
    )


def measure_engine(engine: LLMEngine) -> MachineRates:
    """``measure`` on the engine's device, in its dtype and weight format."""
    runner = engine.runner
    return measure(runner.device, engine.dtype, weight_format(runner.model))


def for_engine(engine: LLMEngine, rates: MachineRates | None = None) -> Roofline:
    """The engine's model on this machine; ``rates`` measured now when not given."""
    runner = engine.runner
    if rates is None:
        rates = measure_engine(engine)
    kv_itemsize = runner.pool.kv_caches[0][0].element_size()
    tiers = runner.weight_tiers()
    cost = ModelCost.of(engine.model_config, runner.weight_bytes(), kv_itemsize, tiers)
    return Roofline(cost, rates)
