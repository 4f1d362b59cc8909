"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import os
import sys


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a number with K, M or G"
        ) from None


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's settings; defaults are the config dataclasses' own."""
    from pdserve.config import (
        KV_CACHE_DTYPES,
        PROMPT_ORDERS,
        CacheConfig,
        EngineConfig,
        SchedulerConfig,
    )
    from pdserve.model.fetch import DEFAULT_MODEL

    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a Hugging Face model folder, a .gguf file, or {DEFAULT_MODEL!r} (default; fetched once)",
    )
    p.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        help="auto (bf16 where the hardware has it, else fp32), bfloat16, float32",
    )
    p.add_argument("--device", default=EngineConfig.device)
    p.add_argument(
        "--quantization",
        default=EngineConfig.quantization,
        help="projection weights: auto (default: gguf where a GGUF model's weights would be fp32 "
        "on the CPU, i.e. no native bf16; else none), none (dense), gguf (a GGUF model's own "
        "Q4_1/Q4_0/Q8_0 blocks, e.g. the default model's 4-bit weights), or quantized at load: "
        "int8 (per channel), q8_0, q4_1, q4_0",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=EngineConfig.threads,
        help="torch threads (default: all cores; a worker pinned with --cpus: one per core of it)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=_size,
        default=CacheConfig.kv_cache_bytes,
        help="KV pool size, e.g. 2G or 512M (default: 10%% of memory)",
    )
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument(
        "--kv-cache-dtype",
        default=CacheConfig.kv_cache_dtype,
        choices=KV_CACHE_DTYPES + ("bf16", "fp32"),
        help="the KV cache's dtype: auto (default: the model's --dtype, but bfloat16 under a "
        "float32 model with quantized weights on the CPU, as the default model is on CPUs "
        "without native bf16), bfloat16 (under a float32 model on the CPU: half the KV bytes a "
        "step reads, twice the blocks a --kv-cache-bytes holds), or float32",
    )
    p.add_argument(
        "--lazy-kv-cache",
        dest="kv_resident",
        action="store_false",
        default=CacheConfig.resident,
        help="map the KV pool's memory as its blocks are first written, not at start (less "
        "memory in use until the pool fills; each first write then costs a page fault under a "
        "request, and memory that is not there fails a request, not the start)",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        default=CacheConfig.enable_prefix_caching,
        help="never reuse the KV of cached prompt prefixes: a prefill or colocated worker "
        "computes them again, a decode worker has them all sent again",
    )
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    p.add_argument(
        "--prompt-order",
        choices=PROMPT_ORDERS,
        default=SchedulerConfig.prompt_order,
        help="which prompts a step computes first: shortest (default: the fewest tokens left to "
        "compute; a prompt passed over waits at most ~4x its own compute time for later ones) or "
        "arrival (first come, first served)",
    )


def _llm_from(args):
    from pdserve.config import CacheConfig, SchedulerConfig
    from pdserve.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        threads=args.threads,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes,
            enable_prefix_caching=args.prefix_caching,
            resident=args.kv_resident,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig.from_args(args),
    )


def _sampling(args):
    from pdserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _generate_remote(args) -> int:
    import grpc

    from pdserve.client import Client

    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    reason = None
    try:
        with Client(args.url, api_key=args.api_key, tls_ca=args.tls_ca) as client:
            for delta in client.generate_stream(prompt, _sampling(args)):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                reason = delta.finish_reason or reason
    except grpc.RpcError as e:
        print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    print(f"[finish_reason={reason}]", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    if args.url:
        return _generate_remote(args)
    llm = _llm_from(args)
    chat = not args.raw and llm.tokenizer is not None and llm.tokenizer.has_chat_template
    prompt = llm.chat_prompt(args.prompt) if chat else args.prompt
    reason = None
    for _, out in llm.generate_stream([prompt], _sampling(args)):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        reason = out.finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={reason}]", file=sys.stderr)
    return 0


def cmd_model_fetch(args) -> int:
    from pdserve.model.fetch import resolve_model

    print(resolve_model(args.model))
    return 0


def cmd_bench_offline(args) -> int:
    from pdserve.bench_offline import run_offline_bench

    run_offline_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from pdserve.sampling_params import SamplingParams

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument(
        "--url", default=None, help="a running gateway (host:port) instead of a local engine"
    )
    g.add_argument(
        "--tls-ca", default=None, help="with --url: dial over TLS, trusting this CA (PEM)"
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="with --url: the key sent as authorization: Bearer (default: $PDSERVE_API_KEY)",
    )
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    # generate's own choices: greedy and 128 tokens (the API's defaults are SamplingParams')
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    g.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    g.add_argument("--seed", type=int, default=SamplingParams.seed)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("model", help="manage models")
    msub = m.add_subparsers(dest="model_command", required=True)
    f = msub.add_parser(
        "fetch", help="fetch and convert a model into the local cache; prints its folder"
    )
    from pdserve.model.fetch import DEFAULT_MODEL

    f.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    f.set_defaults(func=cmd_model_fetch)

    from pdserve.services import cli as serve_cli

    serve_cli.add_commands(sub, _engine_args)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    o = bsub.add_parser(
        "offline",
        help="engine throughput: prefill tokens/s, decode tokens/s at several batch sizes",
    )
    _engine_args(o)
    o.add_argument("--batch-sizes", default="1,8,32,64")
    o.add_argument("--prompt-len", type=int, default=512)
    o.add_argument("--output-len", type=int, default=128)
    o.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also time Hugging Face transformers' generate at batch 1 (needs transformers)",
    )
    o.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="BATCH",
        help="also print where a decode step's time goes (per kernel entry point) at this batch size",
    )
    o.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="BATCH",
        help="also print the host's own time in decode steps at this batch size, by function "
        "(cProfile; on a GPU, what the host does besides launching)",
    )
    o.add_argument("--json", default=None, help="also write the results to this JSON file")
    o.set_defaults(func=cmd_bench_offline)
    from pdserve import bench_serve

    bench_serve.add_command(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
