"""``pdserve bench offline``: prefill and decode throughput of the engine, without servers.

Decode tokens/s at batch B: B requests of ``prompt_len`` random tokens, ``output_len`` new tokens
each (end-of-sequence ignored); only steps in which all B sequences decode (no prefill in them)
count, so the number is pure decode at batch B over contexts of prompt_len..prompt_len+output_len
tokens. The steps with fewer sequences, while prompts are still being prefilled or requests
finish one by one, are reported apart ("all decode steps").

Each batch's roofline fraction (pdserve/roofline.py): the median over those steps of roofline
time / step time, with the bytes a step reads (weights + KV at the median step's context). The
rates are measured with the benchmark's threads before and after the decode runs, each rate the
better of the two (on a shared machine another process's burst only ever lowers one).
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time

import torch

from pdserve import roofline
from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def random_prompt(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab_size - 100) for _ in range(n)]


def time_prefill(llm: LLM, prompt_len: int, repeats: int = 3) -> float:
    """Median seconds to prefill one prompt (and sample its first token)."""
    rng = random.Random(1)
    vocab = llm.engine.model_config.vocab_size
    times = []
    for _ in range(repeats):
        prompt = random_prompt(rng, vocab, prompt_len)  # fresh tokens: no prefix-cache hit
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_decode(
    llm: LLM,
    batch: int,
    prompt_len: int,
    output_len: int,
    steps: list[tuple[roofline.StepWork, float]] | None = None,
) -> dict:
    """Decode throughput of ``batch`` requests. Prompts are prefilled a token budget at a time, so
    the first requests start (and finish) decoding some steps before the last: ``decode_tokens_per_s``
    counts only steps in which all ``batch`` sequences decode (the batch size asked for); the
    ramp-up and drain steps (fewer sequences, no prefill) are in ``all_decode_tokens_per_s``.
    Each of those steps' work and seconds is appended to ``steps`` (for the roofline)."""
    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            random_prompt(rng, vocab, prompt_len), params, request_id=f"bench-{batch}-{i}"
        )
    full, partial = [], []  # (seconds, tokens) of decode-only steps
    while engine.has_unfinished_requests():
        has_prefill = engine.scheduler.has_prompt_work()
        n_running = len(engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not has_prefill:
            (full if n_running == batch else partial).append((dt, n_running))
            if n_running == batch and steps is not None:
                steps.append((engine.last_step, dt))

    def rate(steps: list[tuple[float, int]]) -> float:
        seconds = sum(dt for dt, _ in steps)
        return sum(n for _, n in steps) / seconds if seconds else 0.0

    return {
        "batch": batch,
        "decode_tokens_per_s": rate(full),
        "step_ms_median": 1e3 * statistics.median(dt for dt, _ in full) if full else 0.0,
        "decode_steps": len(full),
        "all_decode_tokens_per_s": rate(full + partial),
    }


def roofline_summary(rl: roofline.Roofline, steps: list[tuple[roofline.StepWork, float]]) -> dict:
    """The median step's fraction of the roofline; the bytes and roofline time at the median
    context."""
    if not steps:
        return {}
    mid = steps[len(steps) // 2][0]
    return {
        "roofline_fraction": statistics.median(rl.fraction(w, dt) for w, dt in steps),
        "roofline_bytes": rl.bytes(mid),
        "roofline_kv_bytes": rl.kv_bytes(mid),
        "roofline_ms": 1e3 * rl.seconds(mid),
    }


def time_hf(
    folder, dtype: torch.dtype, prompt_len: int, output_len: int, device: str = "cpu"
) -> dict:
    """Hugging Face transformers' generate at batch 1, same weights, dtype and device."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.eval()
    rng = random.Random(7)
    ids = torch.tensor([random_prompt(rng, model.config.vocab_size, prompt_len)], device=device)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        out.tolist()  # waits for the device
        return time.perf_counter() - t

    run(2)  # warm-up
    prefill = statistics.median(run(1) for _ in range(3))
    total = run(output_len)
    return {"prefill_s": prefill, "decode_tokens_per_s": (output_len - 1) / (total - prefill)}


def cpu_model() -> str:
    """The CPU's model name (lscpu's), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: str = "cpu") -> str:
    cpu = cpu_model()
    host = f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"
    if device.startswith("cuda"):
        from pdserve.bench_gpu import gpu_description

        return f"{gpu_description(torch.device(device))}; host {host}"
    return host


# The kernel entry points a step's time is split by (the backend's functions, then the rest).
PROFILED_KERNELS = (
    "linear",
    "linear_rows",  # the projections' entry point on the CPU (counted as linear)
    "paged_decode_attention",
    "prefill_attention",
    "rope_write_kv",
    "rms_norm",
    "silu_mul",
)


def start_decoding(engine, batch: int, prompt_len: int, steps: int, tag: str) -> None:
    """Add ``batch`` random prompts and step until every one of them decodes, with room for
    ``steps`` more decode steps before any finishes."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 4 + batch, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = random_prompt(rng, engine.model_config.vocab_size, prompt_len)
        engine.add_request(prompt, params, request_id=f"{tag}-{i}")
    while engine.scheduler.has_prompt_work():
        engine.step()
    engine.step()


def host_profile(llm: LLM, batch: int, prompt_len: int, steps: int = 64, top: int = 30) -> str:
    """The host's own time in ``steps`` decode steps at batch ``batch``, as they run (CUDA graphs,
    the layer loop), by function: cProfile's own time, sorted. On a GPU a step's host time is
    what it does besides the device's work (the scheduler, the step's inputs, the logits' copy,
    sampling); a function that waits for the device (``.cpu()``, a synchronize) shows the wait."""
    import cProfile
    import io
    import pstats

    engine = llm.engine
    start_decoding(engine, batch, prompt_len, 2 * steps, "host")
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain = (time.perf_counter() - start) / steps
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    profiled = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    body = out.getvalue().split("\n", 3)[-1]  # pstats' own header names a temporary object
    return (
        f"host profile of {steps} decode steps at batch {batch}: {1e3 * plain:.2f} ms a step, "
        f"{1e3 * profiled:.2f} ms profiled (cProfile's cost); own time by function:\n{body}"
    )


def profile_decode(llm: LLM, batch: int, prompt_len: int, steps: int = 16) -> str:
    """Where a decode step's time goes: wall time inside each kernel entry point of the model's
    backend (most of it is C, which torch.profiler does not see), the lm_head and sampling, and
    the rest (the embedding lookup, tensor set-up, Python)."""
    engine = llm.engine
    model = engine.runner.model
    ops = model.ops
    spent: dict[str, float] = dict.fromkeys(
        (*PROFILED_KERNELS, "lm_head + logits", "sampling"), 0.0
    )
    depth = [0]  # a call inside another timed one (the lm_head's linear) counts for the outer

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[name] += time.perf_counter() - start

        return wrapper

    import pdserve.runner as runner_module

    patched = [(ops, name, getattr(ops, name)) for name in PROFILED_KERNELS if hasattr(ops, name)]
    patched += [
        (model, "compute_logits", model.compute_logits),
        (runner_module, "sample", runner_module.sample),
    ]
    start_decoding(engine, batch, prompt_len, 2 * steps, "prof")
    # The kernels are timed at their Python entry points, which the layer loop bypasses: the
    # profile runs the module path (same kernels, more Python), and says how long a loop step takes.
    loop_step = None
    if model._layer_loop() is not None:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        loop_step = (time.perf_counter() - start) / steps
    try:
        for owner, name, fn in patched:
            label = {
                "compute_logits": "lm_head + logits",
                "sample": "sampling",
                "linear_rows": "linear",
            }.get(name, name)
            setattr(owner, name, timed(label, fn))
        with model.module_path():
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            total = time.perf_counter() - start
    finally:
        for owner, name, fn in patched:
            if owner is model:  # an instance attribute shadowed the method: drop it
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
    while engine.has_unfinished_requests():
        engine.step()
    rows = [(name, seconds) for name, seconds in spent.items() if seconds > 0]
    rest = total - sum(seconds for _, seconds in rows)
    lines = [
        f"decode step at batch {batch}, {prompt_len}+ tokens of context: "
        f"{1e3 * total / steps:.1f} ms (mean of {steps} steps)",
        f"{'where':<26}{'ms/step':>9}{'share':>8}",
    ]
    for name, seconds in rows:
        label = "linear (30 layers x 4)" if name == "linear" else name
        lines.append(f"{label:<26}{1e3 * seconds / steps:>9.2f}{seconds / total:>8.0%}")
    lines.append(f"{'the rest (Python, setup)':<26}{1e3 * rest / steps:>9.2f}{rest / total:>8.0%}")
    if loop_step is not None:
        lines.append(
            f"(the module path, timed per kernel entry point; the layer loop that runs these steps "
            f"otherwise, same kernels: {1e3 * loop_step:.1f} ms per step)"
        )
    return "\n".join(lines)


def run_offline_bench(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_seqs = max(batches + [args.max_num_seqs])
    kv_tokens = max(batches) * (args.prompt_len + args.output_len) + 1024
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        threads=args.threads,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes,
            enable_prefix_caching=False,
            resident=args.kv_resident,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len),
        ),
    )
    engine = llm.engine
    needed = kv_tokens // args.block_size + 1
    if engine.allocator.num_blocks < needed:
        raise ValueError(
            f"KV cache has {engine.allocator.num_blocks} blocks, the benchmark needs {needed}; "
            f"raise --kv-cache-bytes"
        )
    time_decode(llm, 1, 64, 8)  # warm-up: kernels compiled, allocator touched
    before = roofline.measure_engine(engine)  # with the benchmark's threads
    steps: dict[int, list[tuple[roofline.StepWork, float]]] = {b: [] for b in batches}
    result = {
        "machine": machine_description(args.device),
        "model": args.model,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "kv_dtype": str(engine.kv_dtype).replace("torch.", ""),
        "quantization": engine.runner.model.quantization,  # "auto" resolved
        "weight_bytes": engine.runner.weight_bytes(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prefill_s": time_prefill(llm, args.prompt_len),
        "decode": [
            time_decode(llm, b, args.prompt_len, args.output_len, steps[b]) for b in batches
        ],
    }
    after = roofline.measure_engine(engine)
    rl = roofline.for_engine(engine, roofline.best(before, after))
    for d in result["decode"]:
        d |= roofline_summary(rl, steps[d["batch"]])
    result["roofline"] = {
        "bandwidth_bytes_per_s": rl.rates.bandwidth,
        "bandwidth_bytes_per_s_before_after": [before.bandwidth, after.bandwidth],
        "gemm_flops_per_s": rl.rates.gemm_flops,
        "gemm_flops_per_s_by_kernel": rl.rates.gemm_rates,
        "buffer_bytes": rl.rates.buffer_bytes,
        "seconds": rl.rates.seconds,
    }
    result["prefill_tokens_per_s"] = args.prompt_len / result["prefill_s"]
    if args.hf_baseline:
        from pdserve.model.fetch import resolve_model

        result["hf"] = time_hf(
            resolve_model(args.model), engine.dtype, args.prompt_len, args.output_len, args.device
        )
    if engine.runner.device.type == "cuda":
        from pdserve.bench_gpu import add_mbu, launches_per_step

        add_mbu(result, rl, steps, engine.runner.device)
        try:  # a diagnostic: never fails the benchmark
            prompt = random_prompt(
                random.Random(1), engine.model_config.vocab_size, args.prompt_len
            )
            result["launches_per_decode_step"] = launches_per_step(engine, prompt)
        except Exception as exc:  # noqa: BLE001
            result["launches_per_decode_step"] = {"error": repr(exc)}
    print(f"machine: {result['machine']}")
    print(
        f"model: {args.model} ({result['dtype']}, KV {result['kv_dtype']}, "
        f"weights {result['quantization']}, "
        f"{result['weight_bytes'] / 1e6:.0f} MB), prompt {args.prompt_len} tokens, {args.output_len} new"
    )
    print(
        f"prefill: {result['prefill_s'] * 1e3:.0f} ms for {args.prompt_len} tokens "
        f"({result['prefill_tokens_per_s']:.0f} tokens/s)"
    )
    for d in result["decode"]:
        mbu = f", MBU {d['mbu']:.1%}" if "mbu" in d else ""
        print(
            f"decode batch {d['batch']:>3}: {d['decode_tokens_per_s']:8.1f} tokens/s, "
            f"step {d['step_ms_median']:.2f} ms (median of {d['decode_steps']}){mbu}; all decode "
            f"steps {d['all_decode_tokens_per_s']:.1f} tokens/s"
        )
    if "device_copy_bandwidth_gbps" in result:
        print(
            f"MBU: bytes read per step (weights + KV) / step time / "
            f"{result['device_copy_bandwidth_gbps']:.0f} GB/s (a device-to-device copy here)"
        )
    if "launches_per_decode_step" in result:
        launches = result["launches_per_decode_step"]
        layers = engine.model_config.num_layers
        print(
            f"GPU work per batch-1 decode step: {launches['kernels']:.0f} kernels "
            f"({launches['kernels'] / layers:.1f} a layer), {launches['copies']:.0f} copies; "
            f"the device busy {launches['busy_ms']:.2f} ms of a {launches['step_ms']:.2f} ms step "
            f"(profiled); most time: "
            + ", ".join(
                f"{k['name'][:60]} {k['ms']:.3f} ms ({k['count']:.0f}x)" for k in launches["top"]
            )
            if "kernels" in launches
            else f"GPU work per decode step: not counted ({launches.get('error', 'no CUDA events')})"
        )
    print_roofline(result)
    if "hf" in result:
        hf = result["hf"]
        ours = result["decode"][0]["decode_tokens_per_s"] if batches[0] == 1 else float("nan")
        print(
            f"transformers generate batch 1: {hf['decode_tokens_per_s']:.1f} tokens/s, prefill "
            f"{hf['prefill_s'] * 1e3:.0f} ms; pdserve/transformers decode ratio {ours / hf['decode_tokens_per_s']:.2f}x"
        )
    if getattr(args, "profile", None):
        print(profile_decode(llm, args.profile, args.prompt_len))
    if getattr(args, "host_profile", None):
        print(host_profile(llm, args.host_profile, args.prompt_len))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_roofline(result: dict) -> None:
    r = result["roofline"]
    best = max(r["gemm_flops_per_s_by_kernel"], key=r["gemm_flops_per_s_by_kernel"].get)
    b0, b1 = r["bandwidth_bytes_per_s_before_after"]
    print(
        f"roofline: memory bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (full reads of "
        f"{r['buffer_bytes'] >> 20} MiB; {b0 / 1e9:.1f} before the runs, {b1 / 1e9:.1f} after), "
        f"GEMM {r['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s ({best}); measuring took "
        f"{r['seconds']:.2f} s"
    )
    for d in result["decode"]:
        if "roofline_fraction" in d:
            print(
                f"decode batch {d['batch']:>3}: reads {d['roofline_bytes'] / 1e6:.1f} MB a step "
                f"(weights {(d['roofline_bytes'] - d['roofline_kv_bytes']) / 1e6:.1f} MB + KV "
                f"{d['roofline_kv_bytes'] / 1e6:.1f} MB), roofline {d['roofline_ms']:.2f} ms; "
                f"{d['roofline_fraction']:.0%} of the roofline (median step)"
            )
