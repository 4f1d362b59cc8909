"""Direct transfers: each layer's K and V go straight from the sender's pools into the receiver's.

In a pool ``[num_blocks, block_size, kv_heads, head_dim]`` consecutive block ids are consecutive
memory. Where a transfer's source ids and destination ids are both consecutive over a stretch of
its block list, that stretch of K (and of V) is one piece of memory on each side, sent by UCX
from the one into the other without a copy on either side: a *segment*. A transfer whose ids
split into at most a few segments is sent direct:

    plan     header (256 bytes, as a layer message's) + segment count + segment starts (uint32)
    data     per layer, per K/V, per segment: the raw bytes of that run of blocks (no header)
    trailer  a header for the last layer, carrying the first sampled token

The segments are cut wherever the source or the destination ids stop being consecutive, so the
sender, which knows both (the receiver's ids come with the request), makes them; the plan hands
them to the receiver, which checks them against its own ids. Every message has its own tag (the
transfer id and a sub-tag, ``sub_tag``), so none can land in another's place.

A transfer whose ids are too fragmented (more than ``max_segments`` segments) is sent framed as
before: one ``[header | K | V]`` message per layer, gathered and scattered (pool_copy.py).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

from pdserve.transfer.errors import HeaderMismatchError
from pdserve.transfer.header import HEADER_NBYTES, KVLayout, LayerHeader

SUB_BITS = 16  # a message's UCX tag: (transfer_id << SUB_BITS) | sub
PLAN_SUB = 0xFFFF  # sub-tags; framed layer messages use 0 .. num_layers - 1
TRAILER_SUB = 0xFFFE
MAX_PLAN_SEGMENTS = 64  # what a plan message can carry
_COUNT = struct.Struct("<I")
PLAN_NBYTES = HEADER_NBYTES + _COUNT.size + 4 * MAX_PLAN_SEGMENTS


def message_tag(transfer_id: int, sub: int) -> int:
    """The UCX tag of a transfer's message ``sub`` (a framed layer, or a sub-tag below)."""
    return (transfer_id << SUB_BITS) | sub


def segment_starts(ids: Sequence[int]) -> list[int]:
    """Indices into the transfer's block list where a run of consecutive ``ids`` starts."""
    if not ids:
        raise ValueError("no block ids")
    return [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1]


def fits_tags(num_layers: int, num_segments: int) -> bool:
    """Whether every data message of the transfer has a sub-tag below TRAILER_SUB."""
    return (
        1 <= num_segments <= MAX_PLAN_SEGMENTS
        and num_layers * (1 + 2 * num_segments) <= TRAILER_SUB
    )


def direct_starts(layout: KVLayout, dst: Sequence[int], max_segments: int) -> list[int] | None:
    """The segments of a transfer into blocks ``dst`` (its runs), if it goes direct: at most
    ``max_segments`` of them, and every message's sub-tag fits."""
    starts = segment_starts(dst)
    if len(starts) > max_segments or not fits_tags(layout.num_layers, len(starts)):
        return None
    return starts


def sub_tag(num_layers: int, num_segments: int, layer: int, kv: int, segment: int) -> int:
    """The sub-tag of segment ``segment`` of layer ``layer``'s K (kv=0) or V (kv=1)."""
    return num_layers + (2 * layer + kv) * num_segments + segment


def pack_plan(header: LayerHeader, starts: Sequence[int]) -> bytes:
    return header.pack() + _COUNT.pack(len(starts)) + struct.pack(f"<{len(starts)}I", *starts)


def unpack_plan(
    raw: memoryview | bytes, layout: KVLayout, transfer_id: int, num_blocks: int
) -> tuple[LayerHeader, list[int]]:
    """The plan's header and segment starts; HeaderMismatchError unless they fit this transfer."""
    header = LayerHeader.unpack(raw)
    header.check(layout)
    where = f"transfer {transfer_id}: plan"
    if header.transfer_id != transfer_id:
        raise HeaderMismatchError(f"{where} belongs to transfer {header.transfer_id}")
    if header.num_blocks != num_blocks or header.block_offset != 0:
        raise HeaderMismatchError(
            f"{where} for blocks [{header.block_offset}, {header.block_offset + header.num_blocks}), "
            f"{num_blocks} reserved"
        )
    (count,) = _COUNT.unpack_from(raw, HEADER_NBYTES)
    if not fits_tags(layout.num_layers, count):
        raise HeaderMismatchError(f"{where} has {count} segments")
    starts = list(struct.unpack_from(f"<{count}I", raw, HEADER_NBYTES + _COUNT.size))
    if (
        starts[0] != 0
        or any(b <= a for a, b in itertools.pairwise(starts))
        or starts[-1] >= num_blocks
    ):
        raise HeaderMismatchError(
            f"{where}: segment starts {starts} do not cut {num_blocks} blocks"
        )
    return header, starts


def segment_bounds(starts: Sequence[int], num_blocks: int) -> list[tuple[int, int]]:
    """``[(first block, number of blocks)]`` of each segment."""
    ends = [*starts[1:], num_blocks]
    return [(a, b - a) for a, b in zip(starts, ends, strict=True)]


def plan_nbytes(num_segments: int) -> int:
    """Length of a plan message with ``num_segments`` segments."""
    return HEADER_NBYTES + _COUNT.size + 4 * num_segments
