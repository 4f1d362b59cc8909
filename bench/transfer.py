"""KV transfer benchmark: one prompt's KV (all layers) from a sender process to a receiver process.

    .venv/bin/python bench/transfer.py [--tokens 512] [--reps 9] [--dtype float32 bfloat16]
                                       [--ids random|allocator|runs:N] [--mode pool framed wire]
                                       [--devices cpu-cpu gpu-gpu gpu-cpu cpu-gpu]

Shapes default to the default model (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, block 16).
Measurements per dtype (``--mode``), over UCX between two processes on loopback:

  pool    KV pool to KV pool, as the workers do it: the sender pushes each layer of its pools
          back to back (``start_send(dst_block_ids=...)``, ``send_pool_layer``, ``finish``), the
          receiver lands them in other block ids of its pools (``PoolDestination``). Sent direct
          (plan.py: no gather, no scatter) when the ids cut into few segments, else framed.
  framed  the same without the receiver's ids: always framed, i.e. gathered into message buffers
          (``gather_into``) and scattered from them into the pools (``PoolDestination``).
  wire    the framed transport alone: layers gathered before the clock starts, landed layers
          dropped.

Block ids (``--ids``, both sides): ``allocator`` (default: one run of consecutive blocks, as the
workers' BlockAllocator hands them out while free blocks are not fragmented), ``random`` (the
worst case, every block its own copy: always framed) or ``runs:N`` (N runs at random places). Seconds run from the first send (or gather) to the
receiver's transfer completing (CLOCK_MONOTONIC is shared by processes on one host); bytes count
payload and headers (256 bytes per framed message; plan and trailer of a direct transfer).
Prints the median and range over ``--reps`` transfers after ``--warmup``.

``--devices``: where each side's pools and transport are, sender-receiver (``gpu``: CUDA
memory, each transport made for its device as the workers make it). With a GPU receiver the
clock stops once its device has finished the landing copies.

``--serving N`` measures the workers instead (the default model, bf16): N prompts of ``--tokens``
random tokens through a prefill and a decode worker, one core each; per transfer the prefill
worker's report: bytes, seconds from its first layer's send to the last message taken (the
forward's later layers included), the share of that during which the model was still computing
(``overlap_fraction``), and what was left after the compute.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

if not __package__:  # run as a file: put the repository root on sys.path for `bench.common`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.common import COMMON, DISAGGREGATED  # noqa: E402
from bench.common import ENV as UCX_ENV  # noqa: E402
from pdserve.transfer import (  # noqa: E402
    CallbackDestination,
    PoolDestination,
    create_transport,
    gather_into,
)
from pdserve.transfer.header import KVLayout  # noqa: E402


def _block_ids(pool: int, num_blocks: int, kind: str) -> torch.Tensor:
    """``random``: any blocks of the pool (the worst case: every block its own memcpy);
    ``allocator``: one run of consecutive blocks, as a fresh BlockAllocator hands them out;
    ``runs:N``: N runs of about equal length, at random places of the pool."""
    if kind == "random":
        return torch.randperm(pool)[:num_blocks]
    runs = 1 if kind == "allocator" else int(kind.split(":")[1])
    sizes = [num_blocks // runs + (i < num_blocks % runs) for i in range(runs)]
    slots = torch.randperm(pool // num_blocks * runs)[:runs]  # pool cut in places of max(sizes)
    place = pool // (pool // num_blocks * runs)
    return torch.cat(
        [torch.arange(s * place, s * place + n) for s, n in zip(slots.tolist(), sizes, strict=True)]
    )


def _receiver(
    conn: Connection,
    layout: KVLayout,
    num_blocks: int,
    pool: int,
    args: argparse.Namespace,
    device: str,
) -> None:
    torch.set_num_threads(1)
    shape = (pool, *layout.block_shape)
    k_pools = [
        torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
    ]
    v_pools = [torch.zeros_like(p) for p in k_pools]
    options = dict(
        recv_window=args.recv_window,
        ucx_options=args.ucx_options,
        max_segments=args.max_segments,
        device=device,
    )
    with create_transport("ucx", layout, **options) as transport:
        conn.send(transport.address())
        while (msg := conn.recv()) is not None:
            transfer_id, scatter = msg
            # what the decode worker does: land the transfer in its reserved blocks
            ids = _block_ids(pool, num_blocks, args.ids)
            if scatter:
                dest = PoolDestination(k_pools, v_pools, ids)
            else:
                dest = CallbackDestination(num_blocks, lambda *_: None)
            landed = [0.0, threading.Event()]

            def finished(_, landed=landed):  # noqa: ANN001 - on the transport's thread
                landed[0] = time.monotonic()
                landed[1].set()

            cpu = time.process_time()
            transfer = transport.expect(transfer_id, dest, timeout=30.0)
            transfer.future.add_done_callback(finished)
            conn.send(("ready", ids.tolist()))
            stats = transfer.wait()
            landed[1].wait(30.0)
            if device != "cpu":  # the landing copies were queued on the device: wait for them
                torch.cuda.synchronize(device)
                landed[0] = time.monotonic()
            conn.send((landed[0], stats.nbytes, time.process_time() - cpu))


def _from_receiver(conn, proc, timeout: float = 60.0):  # noqa: ANN001, ANN202
    """The receiver's next message; a clear error, not a hang, if it died (its traceback is on
    stderr) or sends nothing for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the receiver process exited (code {proc.exitcode}); see above")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the receiver sent nothing for {timeout:.0f} s")
    return conn.recv()


def run(
    dtype: str, mode: str, args: argparse.Namespace, src: str = "cpu", dst: str = "cpu"
) -> None:
    layout = KVLayout(
        "bench", getattr(torch, dtype), args.block_size, args.layers, args.kv_heads, args.head_dim
    )
    num_blocks = -(-args.tokens // layout.block_size)
    pool = args.pool_factor * num_blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver,
        args=(child, layout, num_blocks, pool, args, dst),
        daemon=True,
    )
    proc.start()
    k_pools = [
        torch.randn(pool, *layout.block_shape).to(src, layout.dtype)
        for _ in range(layout.num_layers)
    ]
    v_pools = [torch.randn_like(t) for t in k_pools]
    seconds, nbytes, cpu_tx, cpu_rx, post_t = [], 0, [], [], []
    try:
        options = dict(ucx_options=args.ucx_options, max_segments=args.max_segments, device=src)
        with create_transport("ucx", layout, **options) as transport:
            peer = transport.connect(_from_receiver(parent, proc))
            for rep in range(args.warmup + args.reps):
                parent.send((rep, mode != "wire"))
                _, dst_ids = _from_receiver(parent, proc)
                ids = _block_ids(pool, num_blocks, args.ids).to(src)  # where the engine has them
                dst_ids = dst_ids if mode == "pool" else None
                tx = transport.start_send(
                    peer, rep, num_blocks, timeout=30.0, dst_block_ids=dst_ids
                )
                gathered = []
                if mode == "wire":
                    for layer in range(layout.num_layers):
                        k, v = tx.layer_buffers()
                        gather_into(k_pools[layer], v_pools[layer], ids, k, v)
                        gathered.append((k, v))
                cpu = time.process_time()
                start = time.monotonic()
                for layer in range(layout.num_layers):
                    if mode == "wire":
                        tx.send_layer(layer, *gathered[layer])
                    else:  # what the prefill worker does after each layer
                        tx.send_pool_layer(layer, k_pools[layer], v_pools[layer], ids)
                if mode != "wire":
                    tx.finish()  # the prefill worker: with the first token, after sampling
                posted = time.monotonic() - start
                tx.wait()
                cpu = time.process_time() - cpu
                landed, nbytes, rx_cpu = _from_receiver(parent, proc)
                if rep >= args.warmup:
                    seconds.append(landed - start)
                    cpu_tx.append(cpu)
                    cpu_rx.append(rx_cpu)
                    post_t.append(posted)
            parent.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    med = statistics.median(seconds)
    print(
        f"ucx {mode:6s} {dtype:8s} {_label(src)}->{_label(dst)} {args.ids} ids, "
        f"{args.tokens} tokens x {layout.num_layers} layers: "
        f"{nbytes} bytes, median {med * 1e3:.2f} ms = {nbytes / med / 1e9:.2f} GB/s "
        f"(range {nbytes / max(seconds) / 1e9:.2f}-{nbytes / min(seconds) / 1e9:.2f} GB/s, "
        f"{len(seconds)} transfers; CPU per transfer: sender {statistics.median(cpu_tx) * 1e3:.1f} ms, "
        f"receiver {statistics.median(cpu_rx) * 1e3:.1f} ms; all handed to the transport after "
        f"{statistics.median(post_t) * 1e3:.2f} ms)",
        flush=True,
    )


def _label(device: str) -> str:
    return "cpu" if device == "cpu" else "gpu"


def _devices(pair: str) -> tuple[str, str]:
    """``gpu-cpu`` -> ("cuda", "cpu"): sender's and receiver's devices."""
    names = {"cpu": "cpu", "gpu": "cuda"}
    src, _, dst = pair.partition("-")
    if src not in names or dst not in names:
        raise argparse.ArgumentTypeError(f"{pair!r}: expected SENDER-RECEIVER of cpu and gpu")
    return names[src], names[dst]


def serving(args: argparse.Namespace) -> None:
    """``--serving N``: N prompts of ``--tokens`` tokens through a real prefill and decode worker
    (one core each, as bench/disagg_vs_colocated.py), driven below the gateway as the gateway
    drives them; prints what the prefill worker reports of each transfer."""
    import secrets

    import grpc
    from pdserve.services.launcher import start_process, stop_processes

    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    env = {**UCX_ENV, "PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32)}
    procs = []
    try:
        gw = start_process(["gateway", "--port", "0", "--http-port", "-1"], env=env)
        procs.append(gw.proc)
        workers = {}
        for argv in DISAGGREGATED:  # [role, ...]
            w = start_process([*argv, *COMMON, "--gateway", gw.address], env=env)
            procs.append(w.proc)
            workers[argv[0]] = w.address
        rows = []
        gen = torch.Generator().manual_seed(0)
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0)
        with (
            grpc.insecure_channel(workers["decode"]) as dch,
            grpc.insecure_channel(workers["prefill"]) as pch,
        ):
            decode, prefill = worker_pb2_grpc.DecodeStub(dch), worker_pb2_grpc.PrefillStub(pch)
            for i in range(args.warmup + args.serving):
                ids = torch.randint(
                    100, 40000, (args.tokens,), generator=gen
                ).tolist()  # no prefix hits
                rid = f"bench-{i}"
                call = decode.Generate(
                    worker_pb2.DecodeRequest(
                        request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_timeout_ms=30000
                    ),
                    timeout=120,
                )
                dest = next(call).admitted.destination
                out = prefill.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=ids, sampling=sampling, destination=dest
                    ),
                    timeout=120,
                )
                for _ in call:  # the decode side finishes: its blocks are free again
                    pass
                t = out.transfer
                if i >= args.warmup:
                    rows.append((t.bytes, t.seconds, t.gbps, t.overlap_fraction))
                    print(
                        f"transfer {i}: {t.bytes} bytes, {t.seconds * 1e3:.1f} ms, {t.gbps:.3f} GB/s, "
                        f"overlap {t.overlap_fraction:.3f}, after compute {t.seconds * (1 - t.overlap_fraction) * 1e3:.2f} ms",
                        flush=True,
                    )
    finally:
        stop_processes(procs)
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    exposed = statistics.median(s * (1 - o) for _, s, _, o in rows)
    print(
        f"serving, {args.tokens}-token prompts, {len(rows)} transfers: median {med[0]:.0f} bytes, "
        f"{med[1] * 1e3:.1f} ms ({med[2]:.3f} GB/s, the prefill's compute included), overlap "
        f"{med[3]:.3f}, after the compute {exposed * 1e3:.2f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--mode", nargs="+", default=["pool", "framed", "wire"], choices=["pool", "framed", "wire"]
    )
    parser.add_argument(
        "--ids",
        default="allocator",
        help="block ids on both sides: allocator (one run, the default), random (worst case) or runs:N",
    )
    parser.add_argument(
        "--serving",
        type=int,
        default=0,
        metavar="N",
        help="instead: N prompts through real prefill and decode workers (the model's own layout)",
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        type=_devices,
        default=[("cpu", "cpu")],
        metavar="SENDER-RECEIVER",
        help="where each side's pools are: cpu-cpu (default), gpu-gpu, gpu-cpu, cpu-gpu",
    )
    parser.add_argument("--pool-factor", type=int, default=4, help="pool size / transfer size")
    parser.add_argument(
        "--max-segments", type=int, default=2, help="direct up to this many segments"
    )
    parser.add_argument("--recv-window", type=int, default=8, help="receives posted per transfer")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--ucx", action="append", default=[], metavar="KEY=VALUE", help="UCX option, both sides"
    )
    args = parser.parse_args()
    args.ucx_options = dict(item.split("=", 1) for item in args.ucx)
    for key, value in UCX_ENV.items():  # loopback only, like the tests
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    if args.serving:
        serving(args)
        return
    failed = []
    for src, dst in args.devices:
        for dtype in args.dtype:
            for mode in args.mode:
                try:
                    run(dtype, mode, args, src, dst)
                except Exception as exc:  # noqa: BLE001 - the other pairs still run
                    failed.append(f"{mode} {dtype} {_label(src)}->{_label(dst)}: {exc}")
                    print(f"ucx {failed[-1]}: FAILED", flush=True)
    if failed:
        sys.exit(f"{len(failed)} failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
