"""Decode-side prefix reuse on against off (``decode --no-prefix-caching``), side by side in one
run: a gateway + 1 prefill + 1 decode (one core each, KV over UCX, the default model), then the
same requests one after the other: a shared document of about ``--prefix-tokens`` tokens, each
followed by a question of its own. Per setup: KV bytes the decode worker received per request,
prompt tokens it reused, TTFT and latency (p50); then the ratios.

    .venv/bin/python bench/prefix_reuse.py --requests 16 --prefix-tokens 1024 --output-len 32
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.services.launcher import start_process, stop_processes  # noqa: E402

from bench.common import COMMON, DISAGGREGATED, ENV  # noqa: E402
from pdserve import Client, SamplingParams  # noqa: E402
from pdserve.model.fetch import DEFAULT_MODEL, resolve_model  # noqa: E402
from pdserve.tokenizer import Tokenizer  # noqa: E402
from tests.helpers import metric_value  # noqa: E402

WORDS = "river stone light music engine garden paper cloud winter signal bridge mill".split()


def prompts(tok: Tokenizer, n: int, prefix_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    doc: list[int] = []
    while len(doc) < prefix_tokens:
        doc += tok.encode(" ".join(rng.choice(WORDS) for _ in range(64)) + ".")
    doc = doc[:prefix_tokens]
    return [doc + tok.encode(f" Question {i}: what is the {rng.choice(WORDS)}?") for i in range(n)]


def run(decode_flags: list[str], requests: list[list[int]], output_len: int) -> dict:
    env = {**ENV, "PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32)}
    procs = []
    try:
        gw = start_process(["gateway", "--port", "0", "--http-port", "-1"], env=env)
        procs.append(gw.proc)
        decode_metrics = ""
        for argv in DISAGGREGATED:
            flags = decode_flags if argv[0] == "decode" else []
            w = start_process([*argv, *COMMON, *flags, "--gateway", gw.address], env=env)
            procs.append(w.proc)
            decode_metrics = w.metrics if argv[0] == "decode" else decode_metrics
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        kv, reused, ttft, latency, outputs = [], [], [], [], []
        with Client(gw.address, timeout=600) as client:
            for prompt in requests:
                b0 = metric_value(decode_metrics, "pdserve_kv_transfer_bytes_sum", direction="recv")
                r0 = metric_value(decode_metrics, "pdserve_kv_prefix_reused_tokens_total")
                start, first, tokens = time.perf_counter(), None, []
                for delta in client.generate_stream(prompt, params):
                    first = first or time.perf_counter()
                    tokens += delta.token_ids
                latency.append(time.perf_counter() - start)
                ttft.append(first - start)
                outputs.append(tokens)
                kv.append(
                    metric_value(decode_metrics, "pdserve_kv_transfer_bytes_sum", direction="recv")
                    - b0
                )
                reused.append(
                    metric_value(decode_metrics, "pdserve_kv_prefix_reused_tokens_total") - r0
                )
        return {"kv": kv, "reused": reused, "ttft": ttft, "latency": latency, "outputs": outputs}
    finally:
        stop_processes(procs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tok = Tokenizer.from_folder(resolve_model(DEFAULT_MODEL))
    requests = prompts(tok, args.requests, args.prefix_tokens, args.seed)
    print(f"{len(requests)} requests of {len(requests[0])}-{max(map(len, requests))} tokens")
    results = {
        name: run(flags, requests, args.output_len)
        for name, flags in (("reuse", []), ("no reuse", ["--no-prefix-caching"]))
    }
    for name, r in results.items():
        later = slice(1, None)  # the first request finds nothing cached in either setup
        print(
            f"{name}: KV received per request {r['kv'][0] / 1e6:.2f} MB first, "
            f"{statistics.mean(r['kv'][later]) / 1e6:.2f} MB later (mean); "
            f"reused tokens {statistics.mean(r['reused'][later]):.0f}; "
            f"TTFT p50 {statistics.median(r['ttft'][later]) * 1e3:.1f} ms; "
            f"latency p50 {statistics.median(r['latency'][later]) * 1e3:.1f} ms"
        )
    a, b = results["reuse"], results["no reuse"]
    print(
        f"reuse / no reuse: KV bytes {sum(a['kv']) / sum(b['kv']):.3f}x, "
        f"TTFT p50 {statistics.median(a['ttft'][1:]) / statistics.median(b['ttft'][1:]):.2f}x, "
        f"latency p50 "
        f"{statistics.median(a['latency'][1:]) / statistics.median(b['latency'][1:]):.2f}x; "
        f"outputs equal: {a['outputs'] == b['outputs']}"
    )


if __name__ == "__main__":
    main()
