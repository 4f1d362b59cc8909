"""What serving adds to a token at one user (W-c1): the TPOT of one colocated worker behind the
gateway against the offline batch-1 decode step of the same engine, side by side in one run.

For each variant (an environment for the worker and the offline run, e.g. OpenMP's wait policy)
and each round: a gateway and one colocated worker (same dtype, quantization and threads) under
W-c1 (8 requests, 1 user, prompts of 256-768 words, 128 output tokens, greedy, ignore_eos), then
``pdserve bench offline --batch-sizes 1`` in its own process with prompts as long as the served
ones were on average (the server's own count: 564 tokens for the default seed, about a token a
word; 512 before). Reported: the offline step, the served TPOT p50, their ratio (issue 14's target: within
1.10), and the worker's and gateway's CPU per output token. ``--shapes colocated,up`` serves the
same load through ``pdserve up``'s shape too (a prefill and a decode worker pinned to a core
each, borrowing each other's idle core: at one user the decode worker's steps run on both cores,
as the offline step's threads).

    .venv/bin/python bench/serving_overhead.py --threads 2 --rounds 2 --variants default,passive
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import DISAGGREGATED, run_cluster, streaming_args  # noqa: E402

VARIANTS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # idle OpenMP threads sleep instead of spinning
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    # GNU OpenMP's spin before a waiting thread sleeps (default 300000 iterations): short enough
    # to sleep in the gap between steps, long enough to spin through a step's barriers?
    "spin20k": {"GOMP_SPINCOUNT": "20000"},
    "spin2k": {"GOMP_SPINCOUNT": "2000"},
}
# variants that give the decode (or colocated) worker options: streamN = --stream-interval N ms
STREAM_PREFIX = "stream"


def worker_args(variant: str) -> list[str] | None:
    """Options the serving worker gets for ``variant``; None: no such variant."""
    if variant in VARIANTS:
        return []
    interval = variant.removeprefix(STREAM_PREFIX)
    if interval != variant and interval.replace(".", "", 1).isdigit():
        return ["--stream-interval", interval]
    return None


def offline_step_ms(engine_args: list[str], env: dict[str, str], prompt_len: int) -> float:
    """The median batch-1 decode step of ``pdserve bench offline`` after a ``prompt_len``-token
    prompt, in its own process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "offline", *engine_args]
        cmd += ["--batch-sizes", "1", "--prompt-len", str(prompt_len), "--output-len", "128"]
        subprocess.run([*cmd, "--json", out.name], check=True, env={**os.environ, **env})
        with open(out.name) as f:
            return json.load(f)["decode"][0]["step_ms_median"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--variants",
        default="default,passive",
        help=", ".join(VARIANTS) + f", {STREAM_PREFIX}MS (the worker's --stream-interval MS)",
    )
    p.add_argument("--shapes", default="colocated", help="colocated, up")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for v in args.variants.split(","):
        if worker_args(v) is None:
            p.error(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}, or {STREAM_PREFIX}MS")
    model = ["--dtype", args.dtype, "--quantization", args.quantization]
    engine = ["--threads", str(args.threads), *model]
    shapes = {"colocated": [["colocated", *engine]], "up": [[*w, *model] for w in DISAGGREGATED]}
    load = argparse.Namespace(
        requests=8, users=1, rate=None, prompt_words="256-768", output_len=128, seed=0
    )
    rows: dict[str, list[dict]] = {
        f"{shape}/{v}" if shape != "colocated" else v: []
        for shape in args.shapes.split(",")
        for v in args.variants.split(",")
    }
    for r in range(args.rounds):
        for variant, runs in rows.items():
            shape, _, name = variant.rpartition("/")
            env = VARIANTS.get(name, {})
            workers = streaming_args(shapes[shape or "colocated"], worker_args(name))
            s = run_cluster(workers, load, env=env)
            step = offline_step_ms(engine, env, round(s["prompt_tokens_mean"]))
            tpot = s["tpot_s"]["p50"] * 1e3
            tokens = s["output_tokens_per_s"] * s["wall_s"]
            cpu_ms = s["cluster_cpu_s"] / max(tokens, 1) * 1e3
            runs.append({"offline_step_ms": step, "tpot_p50_ms": tpot, "cpu_ms_per_token": cpu_ms})
            print(
                f"round {r} {variant:10s}: served TPOT p50 {tpot:.2f} ms, offline step "
                f"{step:.2f} ms at {s['prompt_tokens_mean']:.0f} prompt tokens "
                f"({tpot / step:.2f}x), cluster CPU {cpu_ms:.1f} ms per output token",
                flush=True,
            )
    print("\nmedians over rounds")
    for variant, runs in rows.items():
        step = statistics.median(x["offline_step_ms"] for x in runs)
        tpot = statistics.median(x["tpot_p50_ms"] for x in runs)
        print(f"{variant:10s}: offline {step:.1f} ms, served {tpot:.1f} ms, {tpot / step:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
