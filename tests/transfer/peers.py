"""Shared KV data and the other side of each UCX test, run as a separate process (spawn).

Both sides derive a transfer's K/V from its seed, so a receiver can check every byte it landed
without the data travelling any other way. Children talk to the test over a Pipe; every wait on
either side has a timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.transfer import (
    CallbackDestination,
    KVDestination,
    KVLayout,
    KVTransport,
    LayerHeader,
    PoolDestination,
    TransferError,
    create_transport,
)

TIMEOUT = 20.0  # generous bound for any single wait in these tests


def default_layout(dtype: torch.dtype = torch.float32, model: str = "SmolLM2-135M") -> KVLayout:
    """The default model's KV layout: 30 layers, 3 KV heads, head_dim 64, block 16."""
    return KVLayout(model, dtype, block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)


def layer_kv(
    layout: KVLayout, num_blocks: int, seed: int, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered K and V of ``layer`` of the transfer with ``seed``, as the sender sends it."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    k = torch.randn(num_blocks, *layout.block_shape, generator=gen).to(layout.dtype)
    v = torch.randn(num_blocks, *layout.block_shape, generator=gen).to(layout.dtype)
    return k, v


def block_ids(
    pool_blocks: int, num_blocks: int, seed: int, run: bool | int = False
) -> torch.Tensor:
    """Distinct block ids for one side of a transfer (different seeds: different ids); with
    ``run``, consecutive ones, as a fresh allocator hands them out; with ``run`` a number n > 1,
    n runs of consecutive ids, the later runs first (so that none joins the next)."""
    gen = torch.Generator().manual_seed(seed)
    if run is not True and run > 1:
        sizes = [num_blocks // run + (i < num_blocks % run) for i in range(run)]
        gap = (pool_blocks - num_blocks) // run
        assert gap >= 1, "no room between the runs"
        starts = [sum(sizes[:i]) + i * gap for i in range(run)]
        return torch.cat(
            [torch.arange(a, a + n) for a, n in reversed(list(zip(starts, sizes, strict=True)))]
        )
    if run:
        start = int(torch.randint(0, pool_blocks - num_blocks + 1, (), generator=gen))
        return torch.arange(start, start + num_blocks)
    return torch.randperm(pool_blocks, generator=gen)[:num_blocks]


class Pools:
    """Per-layer K and V pools ``[pool_blocks, *block_shape]``, zero-filled, on ``device``."""

    def __init__(self, layout: KVLayout, pool_blocks: int, device: str = "cpu") -> None:
        shape = (pool_blocks, *layout.block_shape)
        self.layout = layout
        self.k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]

    def fill(self, ids: torch.Tensor, seed: int) -> None:
        """Put the transfer ``seed``'s KV at ``ids`` (the sender's side)."""
        for layer in range(self.layout.num_layers):
            k, v = layer_kv(self.layout, len(ids), seed, layer)
            self.k[layer][ids] = k.to(self.k[layer].device)
            self.v[layer][ids] = v.to(self.v[layer].device)

    def mismatches(self, ids: torch.Tensor, seed: int) -> list[str]:
        """Layers whose blocks at ``ids`` differ in any byte from transfer ``seed``'s KV, or whose
        other blocks are not all zero (a receiver's side)."""
        bad = []
        others = torch.ones(self.k[0].shape[0], dtype=torch.bool)
        others[ids] = False
        for layer in range(self.layout.num_layers):
            k, v = layer_kv(self.layout, len(ids), seed, layer)
            got_k, got_v = self.k[layer].cpu(), self.v[layer].cpu()
            same = all(
                torch.equal(got[ids].view(torch.uint8), want.view(torch.uint8))
                for got, want in ((got_k, k), (got_v, v))
            )
            clean = not got_k[others].any() and not got_v[others].any()
            if not (same and clean):
                bad.append(f"layer {layer}: bytes equal={same}, other blocks untouched={clean}")
        return bad


def index_copy_into(pools: Pools, ids: torch.Tensor) -> KVDestination:
    """A destination that writes each message into blocks ``ids`` of ``pools`` by itself."""

    def on_layer(header: LayerHeader, k: torch.Tensor, v: torch.Tensor) -> None:
        sel = ids[header.block_offset : header.block_offset + header.num_blocks]
        pools.k[header.layer].index_copy_(0, sel, k)
        pools.v[header.layer].index_copy_(0, sel, v)

    return CallbackDestination(len(ids), on_layer)


def spawn(target: Any, *args: Any) -> tuple[mp.Process, Connection]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent


def recv(conn: Connection, timeout: float = TIMEOUT) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"peer process sent nothing within {timeout} s")
    return conn.recv()


def stop(proc: mp.Process) -> None:
    proc.kill()
    proc.join(TIMEOUT)


# -- child processes ---------------------------------------------------------------------------


def receiver_main(
    conn: Connection, layout: KVLayout, pool_blocks: int, device: str = "cpu"
) -> None:
    """Receive transfers on command, scatter them into this process's own block ids, and report
    ("done", tid, mismatches, bytes, block ids, first token) or ("failed", tid, error type,
    message). ``land`` False: through a callback (``index_copy_into``), not a PoolDestination,
    so that a transport cannot land the transfer in the pools itself. Pools and transport on
    ``device``."""
    torch.set_num_threads(1)
    lock = threading.Lock()

    def reply(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    def run(
        transport: KVTransport,
        tid: int,
        num_blocks: int,
        seed: int,
        timeout: float,
        run: bool | int = False,
        land: bool = True,
    ) -> None:
        pools = Pools(layout, pool_blocks, device)
        ids = block_ids(pool_blocks, num_blocks, seed + 7919, run)
        dest = PoolDestination(pools.k, pools.v, ids) if land else index_copy_into(pools, ids)
        transfer = transport.expect(tid, dest, timeout)
        reply(("expecting", tid))
        try:
            stats = transfer.wait()
        except TransferError as exc:
            reply(("failed", tid, type(exc).__name__, str(exc)))
        else:
            reply(
                (
                    "done",
                    tid,
                    pools.mismatches(ids, seed),
                    stats.nbytes,
                    ids.tolist(),
                    transfer.token_id,
                )
            )

    try:
        with create_transport("ucx", layout, device=device) as transport:
            reply(("address", transport.address()))
            while (cmd := conn.recv()) is not None:
                threading.Thread(target=run, args=(transport, *cmd), daemon=True).start()
    except Exception:  # noqa: BLE001 - shown by the test that waits for a reply
        reply(("crashed", traceback.format_exc()))


def sender_main(conn: Connection, layout: KVLayout, address: bytes, pool_blocks: int) -> None:
    """Reports ("ready",) once connected to ``address``, then sends layers on command:
    ("send", tid, num_blocks, seed, layers[, wait]). Reports ("posted", tid, n)
    once the worker thread has posted every send, then ("sent", tid, n) once the receiver took
    them all (unless ``wait`` is False). Gathers into ``layer_buffers`` as an engine does."""
    torch.set_num_threads(1)
    try:
        with create_transport("ucx", layout) as transport:
            peer = transport.connect(address)
            conn.send(("ready",))
            transfers = {}
            while (cmd := conn.recv()) is not None:
                _, tid, num_blocks, seed, layers, wait = (*cmd, True)[:6]
                if tid not in transfers:
                    pools = Pools(layout, pool_blocks)
                    ids = block_ids(pool_blocks, num_blocks, seed)
                    pools.fill(ids, seed)
                    tx = transport.start_send(peer, tid, num_blocks, timeout=TIMEOUT)
                    transfers[tid] = (tx, pools, ids)
                tx, pools, ids = transfers[tid]
                futures = []
                for layer in layers:
                    k, v = tx.layer_buffers()
                    torch.index_select(pools.k[layer], 0, ids, out=k)
                    torch.index_select(pools.v[layer], 0, ids, out=v)
                    futures.append(tx.send_layer(layer, k, v))
                while not all(f.running() or f.done() for f in futures):
                    time.sleep(0.001)  # the worker thread posts them within microseconds
                conn.send(("posted", tid, len(layers)))
                if not wait:
                    continue
                for fut in futures:
                    fut.result(TIMEOUT)
                conn.send(("sent", tid, len(layers)))
    except Exception:  # noqa: BLE001 - shown by the test that waits for a reply
        conn.send(("crashed", traceback.format_exc()))


def pool_sender_main(conn: Connection, layout: KVLayout, address: bytes, pool_blocks: int) -> None:
    """As a prefill worker sends: on ("send", tid, seed, dst_ids), every layer of transfer
    ``seed``'s KV from this process's pools (direct where the transport can), then the token
    ``tid``. Reports ("posted", tid) once every send is posted, then ("sent", tid) or
    ("failed", tid, error type)."""
    torch.set_num_threads(1)
    try:
        with create_transport("ucx", layout) as transport:
            peer = transport.connect(address)
            conn.send(("ready",))
            while (cmd := conn.recv()) is not None:
                _, tid, seed, dst_ids = cmd
                pools = Pools(layout, pool_blocks)
                ids = block_ids(pool_blocks, len(dst_ids), seed, run=True)
                pools.fill(ids, seed)
                tx = transport.start_send(
                    peer, tid, len(dst_ids), timeout=TIMEOUT, dst_block_ids=dst_ids
                )
                for layer in range(layout.num_layers):
                    tx.send_pool_layer(layer, pools.k[layer], pools.v[layer], ids)
                tx.finish(token_id=tid % 50000)
                conn.send(("posted", tid))
                try:
                    tx.wait()
                except TransferError as exc:
                    conn.send(("failed", tid, type(exc).__name__))
                else:
                    conn.send(("sent", tid))
    except Exception:  # noqa: BLE001 - shown by the test that waits for a reply
        conn.send(("crashed", traceback.format_exc()))
