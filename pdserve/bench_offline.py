"""``pdserve bench offline``: prefill and decode throughput of the engine, without servers.

Decode tokens/s at batch B: B requests of ``prompt_len`` random tokens, ``output_len`` new tokens
each (end-of-sequence ignored); only steps without any prefill in them count, so the number is
pure decode over contexts of prompt_len..prompt_len+output_len tokens.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time

import torch

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


def time_decode(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict:
    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(random_prompt(rng, vocab, prompt_len), params, request_id=f"bench-{batch}-{i}")
    step_times = []
    decode_tokens = 0
    while engine.has_unfinished_requests():
        has_prefill = bool(engine.scheduler.waiting) or any(s.in_prefill for s in engine.scheduler.running)
        n_running = len(engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not has_prefill:
            step_times.append(dt)
            decode_tokens += n_running
    total = sum(step_times)
    return {
        "batch": batch,
        "decode_tokens_per_s": decode_tokens / total if total else 0.0,
        "step_ms_median": 1e3 * statistics.median(step_times) if step_times else 0.0,
        "decode_steps": len(step_times),
    }


def time_hf(folder, dtype: torch.dtype, prompt_len: int, output_len: int) -> dict:
    """Hugging Face transformers' generate at batch 1, same weights and dtype."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    rng = random.Random(7)
    ids = torch.tensor([random_prompt(rng, model.config.vocab_size, prompt_len)])

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    run(2)  # warm-up
    prefill = statistics.median(run(1) for _ in range(3))
    total = run(output_len)
    return {"prefill_s": prefill, "decode_tokens_per_s": (output_len - 1) / (total - prefill)}


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"


def profile_decode(llm: LLM, batch: int, prompt_len: int, steps: int = 8) -> str:
    """Top operators of a few decode steps (torch.profiler), to see what bounds a step."""
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(random_prompt(rng, engine.model_config.vocab_size, prompt_len), params,
                           request_id=f"prof-{i}")
    while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def run_offline_bench(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_seqs = max(batches + [args.max_num_seqs])
    kv_tokens = max(batches) * (args.prompt_len + args.output_len) + 1024
    llm = LLM(args.model, dtype=args.dtype, device=args.device, threads=args.threads,
              cache=CacheConfig(block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
                                enable_prefix_caching=False),
              scheduler=SchedulerConfig(max_num_seqs=max_seqs,
                                        max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len)))
    engine = llm.engine
    needed = kv_tokens // args.block_size + 1
    if engine.allocator.num_blocks < needed:
        raise ValueError(f"KV cache has {engine.allocator.num_blocks} blocks, the benchmark needs {needed}; "
                         f"raise --kv-cache-bytes")
    time_decode(llm, 1, 64, 8)  # warm-up: kernels compiled, allocator touched
    result = {
        "machine": machine_description(),
        "model": args.model,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prefill_s": time_prefill(llm, args.prompt_len),
        "decode": [time_decode(llm, b, args.prompt_len, args.output_len) for b in batches],
    }
    result["prefill_tokens_per_s"] = args.prompt_len / result["prefill_s"]
    if args.hf_baseline:
        from pdserve.model.fetch import resolve_model

        result["hf"] = time_hf(resolve_model(args.model), engine.dtype, args.prompt_len, args.output_len)
    print(f"machine: {result['machine']}")
    print(f"model: {args.model} ({result['dtype']}), prompt {args.prompt_len} tokens, {args.output_len} new")
    print(f"prefill: {result['prefill_s'] * 1e3:.0f} ms for {args.prompt_len} tokens "
          f"({result['prefill_tokens_per_s']:.0f} tokens/s)")
    for d in result["decode"]:
        print(f"decode batch {d['batch']:>3}: {d['decode_tokens_per_s']:8.1f} tokens/s, "
              f"step {d['step_ms_median']:.1f} ms (median of {d['decode_steps']})")
    if "hf" in result:
        hf = result["hf"]
        ours = result["decode"][0]["decode_tokens_per_s"] if batches[0] == 1 else float("nan")
        print(f"transformers generate batch 1: {hf['decode_tokens_per_s']:.1f} tokens/s, prefill "
              f"{hf['prefill_s'] * 1e3:.0f} ms; pdserve/transformers decode ratio {ours / hf['decode_tokens_per_s']:.2f}x")
    if getattr(args, "profile", None):
        print(profile_decode(llm, args.profile, args.prompt_len))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result
