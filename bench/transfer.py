"""KV transfer benchmark: one prompt's KV (all layers) from a sender process to a receiver process.

    .venv/bin/python bench/transfer.py [--tokens 512] [--reps 9] [--dtype float32 bfloat16]
                                       [--ids random|allocator]

Shapes default to the default model (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, block 16).
Two measurements per dtype, over UCX between two processes on loopback:

  pool   KV pool to KV pool, as the workers do it: the sender gathers each layer's blocks from its
         pools straight into the transport's message buffers (``layer_buffers`` + ``gather_into``)
         and pushes the layers back to back; the receiver scatters each into other block ids of
         its pools (``scatter_into``).
  wire   the transport alone: layers gathered before the clock starts, received layers dropped.

Block ids (``--ids``, both sides): ``random`` (default; the worst case, every block its own copy)
or ``allocator`` (one run of consecutive blocks, as a fresh BlockAllocator hands them out).
Seconds run from the first gather (pool) or send (wire) to the receiver's last ``on_layer``
(CLOCK_MONOTONIC is shared by processes on one host); bytes count payload and 256-byte headers.
Prints the median and range over ``--reps`` transfers after ``--warmup``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

if not __package__:  # run as a file: bench/ is on sys.path and bench/kernels.py would shadow `kernels`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from pdserve.transfer import create_transport, gather_into, scatter_into  # noqa: E402
from pdserve.transfer.header import KVLayout  # noqa: E402

UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _block_ids(pool: int, num_blocks: int, kind: str) -> torch.Tensor:
    """``random``: any blocks of the pool (the worst case: every block its own memcpy);
    ``allocator``: one run of consecutive blocks, as a fresh BlockAllocator hands them out."""
    if kind == "random":
        return torch.randperm(pool)[:num_blocks]
    start = int(torch.randint(0, pool - num_blocks + 1, ()))
    return torch.arange(start, start + num_blocks)


def _receiver(
    conn: Connection,
    layout: KVLayout,
    num_blocks: int,
    pool: int,
    args: argparse.Namespace,
) -> None:
    torch.set_num_threads(1)
    k_pools = [
        torch.zeros(pool, *layout.block_shape, dtype=layout.dtype) for _ in range(layout.num_layers)
    ]
    v_pools = [torch.zeros_like(p) for p in k_pools]
    options = dict(recv_window=args.recv_window, ucx_options=args.ucx_options)
    with create_transport("ucx", layout, **options) as transport:
        conn.send(transport.address())
        while (msg := conn.recv()) is not None:
            transfer_id, scatter = msg
            # what the decode worker does: scatter_into its reserved blocks
            land = scatter_into(k_pools, v_pools, _block_ids(pool, num_blocks, args.ids))
            last = [0.0]

            def on_layer(header, k, v, land=land, last=last, scatter=scatter):  # noqa: ANN001
                if scatter:
                    land(header, k, v)
                last[0] = time.monotonic()

            transfer = transport.expect(transfer_id, num_blocks, on_layer, timeout=30.0)
            conn.send("ready")
            stats = transfer.wait()
            conn.send((last[0], stats.nbytes))


def run(dtype: str, mode: str, args: argparse.Namespace) -> None:
    layout = KVLayout(
        "bench", getattr(torch, dtype), args.block_size, args.layers, args.kv_heads, args.head_dim
    )
    num_blocks = -(-args.tokens // layout.block_size)
    pool = 4 * num_blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver,
        args=(child, layout, num_blocks, pool, args),
        daemon=True,
    )
    proc.start()
    k_pools = [
        torch.randn(pool, *layout.block_shape).to(layout.dtype) for _ in range(layout.num_layers)
    ]
    v_pools = [torch.randn_like(t) for t in k_pools]
    seconds, nbytes = [], 0
    try:
        with create_transport("ucx", layout, ucx_options=args.ucx_options) as transport:
            peer = transport.connect(parent.recv())
            for rep in range(args.warmup + args.reps):
                parent.send((rep, mode == "pool"))
                assert parent.recv() == "ready"
                ids = _block_ids(pool, num_blocks, args.ids)
                tx = transport.start_send(peer, rep, num_blocks, timeout=30.0)
                gathered = []
                if mode == "wire":
                    for layer in range(layout.num_layers):
                        k, v = tx.layer_buffers()
                        gather_into(k_pools[layer], v_pools[layer], ids, k, v)
                        gathered.append((k, v))
                start = time.monotonic()
                for layer in range(layout.num_layers):
                    if mode == "wire":
                        k, v = gathered[layer]
                    else:  # what the prefill worker does after each layer
                        k, v = tx.layer_buffers()
                        gather_into(k_pools[layer], v_pools[layer], ids, k, v)
                    tx.send_layer(layer, k, v)
                tx.wait()
                landed, nbytes = parent.recv()
                if rep >= args.warmup:
                    seconds.append(landed - start)
            parent.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    med = statistics.median(seconds)
    print(
        f"ucx {mode:4s} {dtype:8s} {args.ids} ids, {args.tokens} tokens x {layout.num_layers} layers: "
        f"{nbytes} bytes, median {med * 1e3:.2f} ms = {nbytes / med / 1e9:.2f} GB/s "
        f"(range {nbytes / max(seconds) / 1e9:.2f}-{nbytes / min(seconds) / 1e9:.2f} GB/s, "
        f"{len(seconds)} transfers)",
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
    parser.add_argument("--mode", nargs="+", default=["pool", "wire"], choices=["pool", "wire"])
    parser.add_argument(
        "--ids", default="random", choices=["random", "allocator"],
        help="block ids on both sides: random (worst case) or one run, as a fresh allocator's",
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
    for dtype in args.dtype:
        for mode in args.mode:
            run(dtype, mode, args)


if __name__ == "__main__":
    main()
