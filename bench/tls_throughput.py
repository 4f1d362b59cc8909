"""Throughput with TLS + mutual TLS on against off: `pdserve up` (1 prefill + 1 decode, one core
each, a cluster token) against `pdserve up --tls` (TLS to the client, mutual TLS between the
processes), each followed by the same closed loop of users, in alternating rounds within one run.

    .venv/bin/python bench/tls_throughput.py --users 32 --requests 96 --rounds 2 --json out.json
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ENV, load_parser, warm_then_load  # noqa: E402


def up(tls: bool) -> tuple[subprocess.Popen, str, str | None]:
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", "-1"]
    argv += ["--kv-cache-bytes", "2G", "--log-format", "json"] + (["--tls"] if tls else [])
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **ENV},
    )
    address = ca = None
    for line in proc.stdout:
        if line.startswith("pdserve is up: gateway at "):
            address = line.split()[5]
        elif line.startswith("TLS: CA "):
            ca = line.split()[2]
        elif line.startswith("processes: "):
            break
    if address is None:
        raise RuntimeError(f"pdserve up exited with {proc.wait()} before it was up")
    return proc, address, ca


def one_round(tls: bool, args) -> dict:
    proc, address, ca = up(tls)
    try:
        return warm_then_load(address, args, ca)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def main() -> None:
    p = load_parser(requests=96, users=32, prompt_words="64-256", output_len=32)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"plain": [], "tls": []}
    for r in range(args.rounds):
        for mode in ("plain", "tls") if r % 2 == 0 else ("tls", "plain"):
            s = one_round(mode == "tls", args)
            runs[mode].append(s)
            print(
                f"round {r} {mode:5s}: {s['output_tokens_per_s']:.1f} output tok/s, "
                f"TTFT p50 {s['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50 "
                f"{s['tpot_s']['p50'] * 1e3:.0f} ms, errors {s['errors']}",
                flush=True,
            )
    tput = {m: statistics.median(s["output_tokens_per_s"] for s in runs[m]) for m in runs}
    print(
        f"median output tok/s: plain {tput['plain']:.1f}, TLS+mTLS {tput['tls']:.1f}: "
        f"TLS/plain = {tput['tls'] / tput['plain']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_output_tokens_per_s": tput, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
