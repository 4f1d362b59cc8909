"""Memory-bandwidth utilisation (MBU) of decode on a GPU, for ``pdserve bench offline --device cuda``.

A decode step at small batch is bound by memory: it reads every weight once and each sequence's
KV. MBU = bytes a step reads / step time / the device's bandwidth, where the bandwidth is what a
large device-to-device copy reaches here (bytes read plus bytes written), measured on the spot
rather than taken from a data sheet. The bytes counted per step:

    weights (each tensor once, as the engine holds them)
  + batch x mean context x KV bytes per token (K and V, every layer)

with the mean context of the timed steps taken as prompt_len + output_len / 2. Activations,
logits and the block tables are left out (well under 1% at this model's sizes).
"""

from __future__ import annotations

import torch

COPY_BYTES = 1 << 30  # large enough that launch overhead is noise, small enough for any GPU
COPY_REPEATS = 20


def device_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Bytes per second a device-to-device copy of ``nbytes`` moves, read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPY_REPEATS):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    return 2 * nbytes * COPY_REPEATS / seconds


def kv_bytes_per_token(engine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize


def decode_bytes_per_step(engine, batch: int, context_tokens: float) -> int:
    """What one decode step of ``batch`` sequences of ``context_tokens`` each reads."""
    return engine.runner.weight_bytes() + int(batch * context_tokens * kv_bytes_per_token(engine))


def add_mbu(result: dict, engine) -> float:
    """Add ``bytes_per_step`` and ``mbu`` to each of ``result['decode']`` (``bench_offline``'s
    rows, with their median step time) and the measured bandwidth to ``result``; returns it."""
    bandwidth = device_bandwidth(engine.runner.device)
    result["device_bandwidth_gbps"] = bandwidth / 1e9
    context = result["prompt_len"] + result["output_len"] / 2
    for row in result["decode"]:
        nbytes = decode_bytes_per_step(engine, row["batch"], context)
        step_s = row["step_ms_median"] / 1e3
        row["bytes_per_step"] = nbytes
        row["mbu"] = nbytes / step_s / bandwidth if step_s else 0.0
    return bandwidth


def gpu_description(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
