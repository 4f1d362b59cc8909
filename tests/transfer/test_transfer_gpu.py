"""UCX moving KV in GPU memory, byte-exact: GPU to GPU, GPU to CPU and CPU to GPU, with both
transports in this process and with the receiver in another process (as a decode worker is).
Each transport is made for its side's device, as a worker makes it (services/main.py), so
buffers, gathers and landings are in CUDA memory. The CPU pair runs everywhere (marked
``gpu``, the others skip without CUDA; scripts/gpu-check runs them)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.transfer.header import KVLayout
from pdserve.transfer.ucx import UCXTransport
from tests.gpu import DEVICE_PAIRS
from tests.transfer.peers import TIMEOUT, Pools, block_ids, default_layout
from tests.transfer.test_transfer_interface import NUM_BLOCKS, POOL_BLOCKS, Source, expect
from tests.transfer.test_transfer_ucx import RemoteReceiver

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
_ids = itertools.count(5000)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src, dst", DEVICE_PAIRS)
def test_in_process_pair_lands_every_layer_byte_exact(
    src: str, dst: str, dtype: torch.dtype
) -> None:
    layout = default_layout(dtype)
    with UCXTransport(layout, device=src) as sender, UCXTransport(layout, device=dst) as receiver:
        tid = next(_ids)
        transfer, pools, ids = expect(receiver, tid, seed=tid, device=dst)
        source = Source(sender, sender.connect(receiver.address()), tid, seed=tid, device=src)
        futures = source.send(range(layout.num_layers))
        stats = transfer.wait()
        for fut in futures:
            fut.result(TIMEOUT)
        assert source.tx.device.type == src  # gathered where the sender's pools are
        assert pools.k[0].device.type == dst
        assert pools.mismatches(ids, seed=tid) == []
        assert stats.nbytes == layout.num_layers * layout.message_nbytes(NUM_BLOCKS)


@pytest.mark.parametrize("src, dst", DEVICE_PAIRS)
def test_pool_sends_as_a_prefill_worker_makes_them_land_byte_exact(src: str, dst: str) -> None:
    """``send_pool_layer`` from the sender's pools with the receiver's block ids (the prefill
    worker's route: direct between CPU pools, gathered on the device otherwise), and the first
    token in the trailer."""
    layout = default_layout(torch.bfloat16)
    with UCXTransport(layout, device=src) as sender, UCXTransport(layout, device=dst) as receiver:
        tid = next(_ids)
        transfer, pools, dst_ids = expect(receiver, tid, seed=tid, device=dst)
        src_pools = Pools(layout, POOL_BLOCKS, src)
        src_ids = block_ids(POOL_BLOCKS, NUM_BLOCKS, seed=tid, run=True).to(src)  # as the engine
        src_pools.fill(src_ids, seed=tid)
        peer = sender.connect(receiver.address())
        tx = sender.start_send(peer, tid, NUM_BLOCKS, TIMEOUT, dst_block_ids=dst_ids.tolist())
        for layer in range(layout.num_layers):
            tx.send_pool_layer(layer, src_pools.k[layer], src_pools.v[layer], src_ids)
        tx.finish(token_id=4242)
        transfer.wait()
        tx.wait()
        assert transfer.token_id == 4242
        assert pools.mismatches(dst_ids, seed=tid) == []


@pytest.mark.parametrize("src, dst", DEVICE_PAIRS)
def test_receiver_in_another_process_lands_byte_exact(src: str, dst: str) -> None:
    """Across processes (CUDA IPC or staged copies, whichever UCX picks), as from a prefill to a
    decode worker; the receiver checks every byte in its own pools."""
    receiver = RemoteReceiver(torch.bfloat16, device=dst)
    try:
        with UCXTransport(receiver.layout, device=src) as sender:
            tid = next(_ids)
            receiver.expect(tid, seed=tid)
            source = Source(sender, sender.connect(receiver.address), tid, seed=tid, device=src)
            source.send(range(receiver.layout.num_layers))
            stats = source.tx.wait()
            kind, _, mismatches, nbytes = receiver.result(tid)[:4]
            assert (kind, mismatches) == ("done", [])
            assert nbytes == stats.nbytes
    finally:
        receiver.close()


@pytest.mark.parametrize("src, dst", DEVICE_PAIRS)
def test_small_messages_of_concurrent_transfers_land_byte_exact(src: str, dst: str) -> None:
    """As a prefill engine ships a batch of short prompts of a small model: messages of ~2 KB
    (UCX sends them eagerly, not by rendezvous), four transfers under way at once, each layer of
    every prompt before the next layer, the last layers held until ``finish``."""
    layout = KVLayout(
        "tiny", torch.bfloat16, block_size=2, num_layers=2, num_kv_heads=1, head_dim=8
    )
    with UCXTransport(layout, device=src) as sender, UCXTransport(layout, device=dst) as receiver:
        peer = sender.connect(receiver.address())
        tids = [next(_ids) for _ in range(4)]
        src_pools = Pools(layout, POOL_BLOCKS * len(tids), src)
        sends, lands = [], []
        for n, tid in enumerate(tids):
            transfer, pools, dst_ids = expect(receiver, tid, seed=tid, device=dst)
            src_ids = block_ids(POOL_BLOCKS, NUM_BLOCKS, seed=tid, run=True) + n * POOL_BLOCKS
            src_pools.fill(src_ids, seed=tid)
            tx = sender.start_send(peer, tid, NUM_BLOCKS, TIMEOUT, dst_block_ids=dst_ids.tolist())
            sends.append((tx, src_ids.to(src)))
            lands.append((transfer, pools, dst_ids))
        for layer in range(layout.num_layers):
            for tx, ids in sends:
                tx.send_pool_layer(layer, src_pools.k[layer], src_pools.v[layer], ids)
        for n, (tx, _) in enumerate(sends):
            tx.finish(token_id=n)
        for n, tid in enumerate(tids):
            (tx, _), (transfer, pools, dst_ids) = sends[n], lands[n]
            tx.wait()
            transfer.wait()
            assert transfer.token_id == n
            assert pools.mismatches(dst_ids, seed=tid) == []
