"""Memory-bandwidth utilisation (MBU) of decode on a GPU, for ``pdserve bench offline --device cuda``.

A decode step at small batch is bound by memory: it reads every weight once and each sequence's
KV. MBU = bytes a step reads / step time / the device's bandwidth, the median over the steps in
which the whole batch decodes. The bytes are the roofline's (pdserve/roofline.py: the weights as
stored, each once, plus every context token's K and V that the step reads). The bandwidth is
what a large device-to-device copy reaches here, bytes read plus written, measured on the spot
rather than taken from a data sheet (the roofline's own bandwidth is a read-only figure).
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.roofline import Roofline, StepWork

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


def mbu(rl: Roofline, steps: list[tuple[StepWork, float]], bandwidth: float) -> float:
    """The median over ``steps`` (each one's work and seconds) of bytes read / seconds /
    ``bandwidth``; 0.0 without steps."""
    if not steps:
        return 0.0
    return statistics.median(rl.bytes(work) / seconds / bandwidth for work, seconds in steps)


def add_mbu(
    result: dict, rl: Roofline, steps: dict[int, list[tuple[StepWork, float]]], device
) -> None:
    """``mbu`` of each row of ``result['decode']`` (bench_offline's, ``steps`` by batch size)
    at the bandwidth measured now on ``device``, which goes into ``result`` too."""
    bandwidth = device_bandwidth(device)
    result["device_copy_bandwidth_gbps"] = bandwidth / 1e9
    for row in result["decode"]:
        row["mbu"] = mbu(rl, steps[row["batch"]], bandwidth)


def gpu_description(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"


def launches_per_step(engine, prompt: list[int], steps: int = 4) -> dict:
    """What the GPU runs per batch-1 decode step of ``engine``: kernels and memory copies
    (torch.profiler's CUDA activity, over ``steps`` steps of one request with ``prompt``), the
    time the device was busy with them against the step's wall time, and the kernels that took
    most of it. On a host that launches slowly a step is bound by their count (the first GPU
    run: ~41 kernels a layer, ~1 ms a layer on an H100 VM); a step whose device is busy most of
    it is bound by the kernels themselves. {} if the profiler saw no CUDA activity."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, supported_activities

    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    engine.add_request(prompt, params, request_id="launch-count")
    try:
        while engine.scheduler.has_prompt_work():
            engine.step()
        engine.step()
        if ProfilerActivity.CUDA not in supported_activities():  # a CPU-only torch
            return {}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        engine.abort_request("launch-count")
    kernels = copies = 0
    busy_us: dict[str, list[float]] = {}  # name -> [microseconds, count]
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name.lower()
        if "memcpy" in name or "memset" in name:
            copies += 1
        else:
            kernels += 1
        spent = busy_us.setdefault(event.name, [0.0, 0])
        spent[0] += event.time_range.elapsed_us()
        spent[1] += 1
    if not kernels:
        return {}
    ranked = sorted(busy_us.items(), key=lambda kv: -kv[1][0])
    return {
        "kernels": kernels / steps,
        "copies": copies / steps,
        "step_ms": 1e3 * wall / steps,
        "busy_ms": sum(us for us, _ in busy_us.values()) / 1e3 / steps,
        "top": [
            {"name": name, "ms": us / 1e3 / steps, "count": n / steps}
            for name, (us, n) in ranked[:8]
        ],
    }
