"""Repeated-prefix chat: routing policy ``cost`` against ``--against`` (``round_robin``), side by
side in one run.

One set of real processes: 2 prefill workers (one core each) and 1 decode worker, registered with
two gateways, one per policy. Each round runs ``--sessions`` chat sessions at once, each
``--turns`` turns long, a random pause before each: every turn sends the whole conversation (a
system prompt of ``--system-words`` words, then the user and assistant turns so far, then a new
user message of ``--user-words`` words) and appends the streamed reply. Each round has
``--system-prompts`` system prompts of its own (no round finds another's in a cache), session i
using prompt i mod that (several applications, each with its own long instructions, sharing one
cluster), and the rounds alternate between the gateways (the other policy first, then cost,
...). Prints TTFT percentiles per policy and cost / the other.

    .venv/bin/python bench/prefix_routing.py --rounds 4 --json out.json
    .venv/bin/python bench/prefix_routing.py --rounds 4 --system-prompts 4 --prefill-kv-cache-bytes 200M
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

from bench.common import TWO_PREFILL, gateways_and_workers  # noqa: E402
from pdserve.bench_offline import cpu_model  # noqa: E402
from pdserve.bench_serve import WORDS, percentiles  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from pdserve.v1.convert import sampling_to_proto  # noqa: E402


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


CHAT_OPTIONS = (  # flag, type, help: the chat benchmarks' (this one, bench/chat_turns.py)
    ("--rounds", int, "rounds measured"),
    ("--sessions", int, "chat sessions at once"),
    ("--turns", int, "turns per session"),
    ("--system-words", int, "each system prompt's words"),
    ("--output-len", int, "tokens per reply"),
    ("--think-s", float, "a user waits uniform(0, this) seconds before each turn"),
)


def add_chat_options(p: argparse.ArgumentParser, defaults: dict, helps: dict | None = None):
    """CHAT_OPTIONS with these defaults (and helps where given), and ``--user-words LO-HI``."""
    for flag, kind, what in CHAT_OPTIONS:
        help_ = (helps or {}).get(flag, what)
        p.add_argument(flag, type=kind, default=defaults[flag], help=help_)
    p.add_argument("--user-words", type=lambda s: tuple(map(int, s.split("-"))), default=(20, 40))


async def session(stub, system: str, rng: random.Random, args, key: str) -> list[float]:
    """One chat session's turns, one after the other; the TTFT of each."""
    messages = [generation_pb2.ChatMessage(role="system", content=system)]
    params = sampling_to_proto(
        SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    )
    ttfts = []
    for _ in range(args.turns):
        await asyncio.sleep(rng.uniform(0, args.think_s))  # the user reads, then types
        lo, hi = args.user_words
        messages.append(
            generation_pb2.ChatMessage(role="user", content=words(rng, rng.randint(lo, hi)))
        )
        req = generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatMessages(messages=messages),
            sampling=params,
            affinity_key=key if args.affinity else "",
        )
        start = time.perf_counter()
        reply, ttft = [], None
        async for delta in stub.Generate(req, timeout=600):
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - start
            reply.append(delta.text)
        ttfts.append(ttft)
        messages.append(generation_pb2.ChatMessage(role="assistant", content="".join(reply)))
    return ttfts


async def one_round(address: str, round_no: int, args) -> tuple[list[list[float]], float]:
    # this round's own system prompt (warm-up rounds are numbered from 1,000)
    rng = random.Random(f"{args.seed}-{round_no}")
    systems = [words(rng, args.system_words) for _ in range(args.system_prompts)]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        began = time.perf_counter()
        runs = [
            session(
                stub,
                systems[i % len(systems)],
                random.Random(rng.random()),
                args,
                f"r{round_no}-s{i}",
            )
            for i in range(args.sessions)
        ]
        per_session = await asyncio.gather(*runs)
        return per_session, time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser()
    think = (
        "a user waits uniform(0, this) seconds before each turn (so sessions interleave at random, "
        "not in lock step: round robin would otherwise keep each session on one worker whenever "
        "the session count is even)"
    )
    defaults = {"--rounds": 4, "--sessions": 8, "--turns": 6, "--system-words": 600}
    defaults |= {"--output-len": 32, "--think-s": 2.0}
    helps = {"--rounds": "alternating, the other policy first", "--think-s": think}
    add_chat_options(p, defaults, helps)
    p.add_argument(
        "--system-prompts",
        type=int,
        default=1,
        help="distinct system prompts per round (session i: i mod this)",
    )
    p.add_argument("--affinity", action="store_true", help="send each session's id as its key")
    p.add_argument("--kv-cache-bytes", default="1G", help="the decode worker's")
    p.add_argument(
        "--prefill-kv-cache-bytes",
        default="1G",
        help="each prefill worker's: its prefix cache (smaller than the sessions' contexts: "
        "round robin makes each worker cache every session, cost about half of them)",
    )
    p.add_argument(
        "--decode-prefill-budget",
        default=None,
        help="the gateways' (default: theirs; 0: every prompt to a prefill worker, so only the "
        "routing between the prefill workers differs)",
    )
    p.add_argument(
        "--warm-replies",
        action="store_true",
        help="both gateways send each finished reply to its prefill worker to keep (a chat's "
        "next turn finds it there)",
    )
    p.add_argument("--against", default="round_robin", help="the policy cost is compared with")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.rounds < 2:
        p.error(
            f"--rounds must be at least 2 (rounds alternate between the two policies), got {args.rounds}"
        )
    policies = (args.against, "cost")
    budget = (
        []
        if args.decode_prefill_budget is None
        else ["--decode-prefill-budget", args.decode_prefill_budget]
    )
    budget += ["--warm-replies"] * args.warm_replies
    gateway_args = {policy: ["--policy", policy, *budget] for policy in policies}
    workers = [
        [
            *argv,
            "--kv-cache-bytes",
            args.prefill_kv_cache_bytes if argv[0] == "prefill" else args.kv_cache_bytes,
        ]
        for argv in TWO_PREFILL
    ]
    with gateways_and_workers(gateway_args, workers) as (gateways, _):
        # warm-up (a round of its own, on both gateways): compiled paths, measured speeds
        for policy in policies:
            asyncio.run(one_round(gateways[policy], 1000 + policies.index(policy), args))
        ttfts: dict[str, list[float]] = {p: [] for p in policies}
        by_turn: dict[str, list[list[float]]] = {
            p: [[] for _ in range(args.turns)] for p in policies
        }
        walls: dict[str, list[float]] = {p: [] for p in policies}
        for r in range(args.rounds):
            policy = policies[r % 2]
            sessions, wall = asyncio.run(one_round(gateways[policy], r, args))
            t = [x for s in sessions for x in s]
            ttfts[policy] += t
            for s in sessions:
                for turn, x in enumerate(s):
                    by_turn[policy][turn].append(x)
            walls[policy].append(wall)
            print(
                f"round {r} {policy}: TTFT p50 {statistics.median(t) * 1000:.0f} ms, "
                f"wall {wall:.1f} s",
                flush=True,
            )
    summary = {
        "cpu": cpu_model(),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "ttft_s": {p: percentiles(ttfts[p]) for p in policies},
        "round_wall_s": walls,
        "ttft_p50_s_by_turn": {p: [statistics.median(t) for t in by_turn[p]] for p in policies},
    }
    other, cost = summary["ttft_s"][args.against], summary["ttft_s"]["cost"]
    summary[f"cost_over_{args.against}"] = {q: cost[q] / other[q] for q in ("p50", "p99", "mean")}
    for policy in policies:
        s = summary["ttft_s"][policy]
        print(
            f"{policy:12s} TTFT p50 {s['p50'] * 1000:7.1f} ms  p99 {s['p99'] * 1000:7.1f} ms  "
            f"({len(ttfts[policy])} requests)"
        )
        turns = " ".join(f"{x * 1000:.0f}" for x in summary["ttft_p50_s_by_turn"][policy])
        print(f"{'':12s} p50 by turn (ms): {turns}")
    ratio = summary[f"cost_over_{args.against}"]
    print(f"cost / {args.against}: p50 {ratio['p50']:.2f}, p99 {ratio['p99']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
