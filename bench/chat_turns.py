"""Multi-turn chat on one serving shape: TTFT by turn, and the prompt tokens each turn found in
the prefix cache of the worker that computed it (``usage.cached_prompt_tokens``).

One gateway and the shape's workers as real processes (``colocated``: one worker with 2 threads;
``disaggregated``: ``pdserve up``'s 1 prefill + 1 decode, a core each). Each round runs
``--sessions`` chat sessions at once, each ``--turns`` turns long, a random pause before each
turn; every turn sends the whole conversation (a system prompt of ``--system-words`` words, the
turns so far with their replies, a new user message) and appends the streamed reply. Each round
has a system prompt of its own; one warm-up round first.

    .venv/bin/python bench/chat_turns.py --shape colocated --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.common import DISAGGREGATED, DISAGGREGATED_NO_BORROW, cluster  # noqa: E402
from bench.prefix_routing import add_chat_options, words  # noqa: E402
from pdserve.bench_offline import cpu_model  # noqa: E402
from pdserve.bench_serve import percentiles  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from pdserve.v1.convert import sampling_to_proto  # noqa: E402

SHAPES = {
    "colocated": [["colocated", "--threads", "2"]],
    "disaggregated": DISAGGREGATED,  # as pdserve up: each borrows the other's core while it idles
    "disaggregated-own-cores": DISAGGREGATED_NO_BORROW,  # a core each, never lent
}


async def session(
    stub, system: str, rng: random.Random, args
) -> list[tuple[float, int, int, float]]:
    """One chat session's turns, one after the other: (TTFT, prompt tokens, cached, TPOT) of
    each."""
    messages = [generation_pb2.ChatMessage(role="system", content=system)]
    params = sampling_to_proto(
        SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=not args.eos)
    )
    turns = []
    for _ in range(args.turns):
        await asyncio.sleep(rng.uniform(0, args.think_s))
        lo, hi = args.user_words
        content = words(rng, rng.randint(lo, hi))
        messages.append(generation_pb2.ChatMessage(role="user", content=content))
        req = generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatMessages(messages=messages), sampling=params
        )
        start = time.perf_counter()
        reply, ttft, usage, last = [], None, None, 0.0
        async for delta in stub.Generate(req, timeout=600):
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - start
            last = time.perf_counter() - start
            reply.append(delta.text)
            if delta.HasField("usage"):
                usage = delta.usage
        tpot = (last - ttft) / max(usage.completion_tokens - 1, 1)
        turns.append((ttft, usage.prompt_tokens, usage.cached_prompt_tokens, tpot))
        messages.append(generation_pb2.ChatMessage(role="assistant", content="".join(reply)))
    return turns


async def one_round(address: str, round_no: int, args) -> list[list[tuple[float, int, int, float]]]:
    rng = random.Random(f"{args.seed}-{round_no}")
    system = words(rng, args.system_words)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        runs = [
            session(stub, system, random.Random(rng.random()), args) for _ in range(args.sessions)
        ]
        return await asyncio.gather(*runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="colocated")
    defaults = {"--rounds": 2, "--sessions": 4, "--turns": 6, "--system-words": 300}
    add_chat_options(p, defaults | {"--output-len": 64, "--think-s": 1.0})
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--local-prefill-tokens",
        default=None,
        help="the gateway's (disaggregated: prompts that leave the decode worker at most this "
        "many tokens to compute are prefilled there)",
    )
    p.add_argument(
        "--eos",
        action="store_true",
        help="a reply ends at the model's end of turn (at most --output-len tokens); default: "
        "every reply is --output-len tokens (ignore_eos)",
    )
    p.add_argument(
        "--warm-replies",
        action="store_true",
        help="disaggregated: the gateway sends each finished reply to its prefill worker to keep",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    local = args.local_prefill_tokens
    gateway_args = [] if local is None else ["--local-prefill-tokens", local]
    gateway_args += ["--warm-replies"] * args.warm_replies
    with cluster(SHAPES[args.shape], gateway_args=gateway_args) as (address, _):
        asyncio.run(one_round(address, 1000, args))  # warm-up
        by_turn: list[list[tuple[float, int, int, float]]] = [[] for _ in range(args.turns)]
        for r in range(args.rounds):
            for s in asyncio.run(one_round(address, r, args)):
                for turn, x in enumerate(s):
                    by_turn[turn].append(x)
    every = [x for t in by_turn for x in t]
    summary = {
        "cpu": cpu_model(),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "ttft_s": percentiles([x[0] for x in every]),
        "tpot_s": percentiles([x[3] for x in every]),
        "ttft_p50_s_by_turn": [statistics.median(x[0] for x in t) for t in by_turn],
        "prompt_tokens_by_turn": [statistics.mean(x[1] for x in t) for t in by_turn],
        "cached_tokens_by_turn": [statistics.mean(x[2] for x in t) for t in by_turn],
        "cached_share": sum(x[2] for x in every) / sum(x[1] for x in every),
    }
    s = summary["ttft_s"]
    t = summary["tpot_s"]
    print(
        f"{args.shape}: TTFT p50 {s['p50'] * 1000:.1f} ms, p99 {s['p99'] * 1000:.1f} ms; "
        f"TPOT p50 {t['p50'] * 1000:.2f} ms, p99 {t['p99'] * 1000:.2f} ms"
    )
    print("by turn: TTFT p50 ms / prompt tokens / cached (means)")
    for i, t in enumerate(summary["ttft_p50_s_by_turn"]):
        prompt, cached = summary["prompt_tokens_by_turn"][i], summary["cached_tokens_by_turn"][i]
        print(f"  {i + 1}: {t * 1000:7.1f} / {prompt:6.0f} / {cached:6.0f}")
    print(f"prompt tokens found cached: {summary['cached_share']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
