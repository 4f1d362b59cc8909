"""KV transfer wire format: the layout both sides agree on, the per-message header, the address blob.

Every message carries one layer's K and V blocks of one transfer, behind a fixed 256-byte header:

    offset  0            256              256 + L            256 + 2L
            | header     | K [n, bs, h, d] | V [n, bs, h, d] |       L = n * bs * h * d * itemsize

The header starts with magic and protocol version at fixed offsets, so that any future version can
still be recognised and rejected with a clear error. ``block_offset``/``num_blocks`` say which slice
of the transfer's block list the message carries (a whole prompt, or one chunk of a chunked prefill).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from pdserve.transfer.errors import HeaderMismatchError

PROTOCOL_VERSION = 2  # 2: direct transfers (plan.py)
MAGIC = b"PDKV"
HEADER_NBYTES = 256  # payload starts 256-byte aligned; room for fields added later

# Wire codes; never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

_PREFIX = struct.Struct("<4sHH")  # magic, version, header length: readable by every version
_FIELDS = struct.Struct("<16sQIIIIB3xIIIq64s")
_ADDRESS_PREFIX = struct.Struct("<4sH16s")  # magic, version, layout hash
ADDRESS_MAGIC = b"PDKA"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_layout_hash(
    model: str,
    dtype: torch.dtype | str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> str:
    """Compatibility hash (32 hex chars) of everything both sides of a transfer must agree on."""
    dtype_name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
    key = f"pdserve-kv|{model}|{dtype_name}|{block_size}|{num_layers}|{num_kv_heads}|{head_dim}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class KVLayout:
    """The KV cache layout of a model as served by one worker: pools are
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, for K and V."""

    model: str
    dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            names = ", ".join(_dtype_name(d) for d in DTYPE_CODES)
            raise ValueError(f"KV dtype {self.dtype} cannot be transferred; use one of: {names}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers > 0xFFFF:
            raise ValueError(f"num_layers must be < 65536, got {self.num_layers}")

    @functools.cached_property
    def compat_hash(self) -> str:
        return kv_layout_hash(
            self.model,
            self.dtype,
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def block_nbytes(self) -> int:
        itemsize = self.dtype.itemsize
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def message_nbytes(self, num_blocks: int) -> int:
        """Bytes of one message carrying ``num_blocks`` blocks of K and of V."""
        return HEADER_NBYTES + 2 * num_blocks * self.block_nbytes()

    def describe(self) -> str:
        return (
            f"{self.model} KV {_dtype_name(self.dtype)} block_size={self.block_size} "
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim}"
        )


@dataclass(frozen=True)
class LayerHeader:
    """What travels in front of one layer's blocks."""

    layout_hash: str
    transfer_id: int
    layer: int
    num_layers: int
    block_offset: int  # index of the first carried block in the transfer's block list
    num_blocks: int
    dtype: torch.dtype
    block_shape: tuple[int, int, int]
    token_id: int = -1  # the first sampled token, sent with the final message; -1: none
    traceparent: str = ""  # W3C trace context of the sending span
    version: int = PROTOCOL_VERSION

    @classmethod
    def for_layer(
        cls,
        layout: KVLayout,
        transfer_id: int,
        layer: int,
        num_blocks: int,
        *,
        block_offset: int = 0,
        token_id: int = -1,
        traceparent: str = "",
    ) -> LayerHeader:
        return cls._make(
            layout.compat_hash,
            transfer_id,
            layer,
            layout.num_layers,
            block_offset,
            num_blocks,
            layout.dtype,
            layout.block_shape,
            token_id,
            traceparent,
            PROTOCOL_VERSION,
        )

    @classmethod
    def _make(cls, *values: object) -> LayerHeader:
        """An instance from every field's value in order, without the dataclass ``__init__``'s
        per-field ``object.__setattr__`` (a few microseconds, paid per message on both sides)."""
        header = object.__new__(cls)
        header.__dict__.update(zip(_FIELD_NAMES, values, strict=True))
        return header

    def pack(self) -> bytes:
        """``HEADER_NBYTES`` bytes."""
        trace = self.traceparent.encode("ascii")
        if len(trace) > 64:
            raise ValueError(f"traceparent longer than 64 bytes: {self.traceparent!r}")
        body = _FIELDS.pack(
            bytes.fromhex(self.layout_hash),
            self.transfer_id,
            self.layer,
            self.num_layers,
            self.block_offset,
            self.num_blocks,
            DTYPE_CODES[self.dtype],
            *self.block_shape,
            self.token_id,
            trace,
        )
        raw = _PREFIX.pack(MAGIC, self.version, HEADER_NBYTES) + body
        return raw.ljust(HEADER_NBYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> LayerHeader:
        magic, version, _ = _PREFIX.unpack_from(raw)
        if magic != MAGIC:
            raise HeaderMismatchError(
                f"not a pdserve KV message (magic {magic!r}, expected {MAGIC!r})"
            )
        if version != PROTOCOL_VERSION:
            raise HeaderMismatchError(
                f"peer speaks KV protocol v{version}, this worker v{PROTOCOL_VERSION}: "
                "run the same pdserve version on prefill and decode workers"
            )
        (lhash, tid, layer, nlayers, offset, nblocks, code, bs, heads, hdim, token, trace) = (
            _FIELDS.unpack_from(raw, _PREFIX.size)
        )
        if code not in CODE_DTYPES:
            raise HeaderMismatchError(f"unknown KV dtype code {code} in message header")
        return cls._make(
            lhash.hex(),
            tid,
            layer,
            nlayers,
            offset,
            nblocks,
            CODE_DTYPES[code],
            (bs, heads, hdim),
            token,
            trace.rstrip(b"\0").decode("ascii"),
            version,
        )

    def check(self, layout: KVLayout) -> None:
        """Raise HeaderMismatchError unless this header fits ``layout``, naming what differs."""
        if (
            self.layout_hash == layout.compat_hash
            and self.dtype == layout.dtype
            and self.block_shape == layout.block_shape
            and self.num_layers == layout.num_layers
            and 0 <= self.layer < self.num_layers
        ):
            return  # the common case, without building the message's parts
        theirs = (_dtype_name(self.dtype), self.block_shape, self.num_layers)
        ours = (_dtype_name(layout.dtype), layout.block_shape, layout.num_layers)
        if self.layout_hash != layout.compat_hash or theirs != ours:
            raise HeaderMismatchError(
                f"transfer {self.transfer_id} layer {self.layer}: sender KV layout "
                f"(hash {self.layout_hash}, dtype/[block_size, kv_heads, head_dim]/layers {theirs}) "
                f"does not match this worker's {layout.describe()} (hash {layout.compat_hash}, {ours}); "
                "prefill and decode must serve the same model, dtype and block size, with the "
                "same KV cache dtype (--kv-cache-dtype)"
            )
        if not 0 <= self.layer < self.num_layers:
            raise HeaderMismatchError(
                f"layer {self.layer} out of range for {self.num_layers} layers"
            )


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LayerHeader))


def check_transfer_id(transfer_id: int) -> None:
    """Transfer ids are chosen by the receiver; 48 bits, so that (id, layer) fits a 64-bit tag."""
    if not 0 <= transfer_id < 1 << 48:
        raise ValueError(f"transfer_id must be in [0, 2**48), got {transfer_id}")


def pack_address(layout: KVLayout, transport_address: bytes) -> bytes:
    """Address blob a receiver publishes: protocol version and layout hash, then the transport's own."""
    prefix = _ADDRESS_PREFIX.pack(
        ADDRESS_MAGIC, PROTOCOL_VERSION, bytes.fromhex(layout.compat_hash)
    )
    return prefix + transport_address


def unpack_address(blob: bytes, layout: KVLayout) -> bytes:
    """The transport part of ``blob``; HeaderMismatchError if the peer cannot take our KV."""
    if len(blob) < _ADDRESS_PREFIX.size or blob[:4] != ADDRESS_MAGIC:
        raise HeaderMismatchError("peer address is not a pdserve KV transport address")
    _, version, lhash = _ADDRESS_PREFIX.unpack_from(blob)
    if version != PROTOCOL_VERSION:
        raise HeaderMismatchError(
            f"peer speaks KV protocol v{version}, this worker v{PROTOCOL_VERSION}: "
            "run the same pdserve version on prefill and decode workers"
        )
    if lhash.hex() != layout.compat_hash:
        raise HeaderMismatchError(
            f"peer KV layout hash {lhash.hex()} differs from this worker's {layout.compat_hash} "
            f"({layout.describe()}); prefill and decode must serve the same model, dtype, block size "
            "and KV cache dtype (--kv-cache-dtype)"
        )
    return blob[_ADDRESS_PREFIX.size :]


def message_views(buf: torch.Tensor, header: LayerHeader) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the message in ``buf`` as views (no copy), ``[num_blocks, *block_shape]`` each."""
    count = header.num_blocks * math.prod(header.block_shape)  # elements of K (and of V)
    nbytes = count * header.dtype.itemsize
    if buf.numel() < HEADER_NBYTES + 2 * nbytes:
        raise HeaderMismatchError(
            f"transfer {header.transfer_id} layer {header.layer}: header announces "
            f"{header.num_blocks} blocks ({2 * nbytes} bytes) but the message buffer holds only "
            f"{buf.numel() - HEADER_NBYTES}"
        )
    first = HEADER_NBYTES // header.dtype.itemsize
    kv = buf[: HEADER_NBYTES + 2 * nbytes].view(header.dtype)[first:]
    kv = kv.view(2, header.num_blocks, *header.block_shape)
    return kv[0], kv[1]


def message_buffer_of(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The message buffer that ``k`` and ``v`` are the views of (see ``message_views``), or None.

    Lets a sender gather a layer straight into a message and send it without another copy."""
    storage = k.untyped_storage()
    itemsize = k.element_size()
    nbytes = k.numel() * itemsize
    if (
        k.storage_offset() * itemsize == HEADER_NBYTES
        and v.storage_offset() * itemsize == HEADER_NBYTES + nbytes
        and storage.nbytes() == HEADER_NBYTES + 2 * nbytes
        and v.untyped_storage().data_ptr() == storage.data_ptr()
        and k.is_contiguous()
        and v.is_contiguous()
    ):
        return torch.empty(0, dtype=torch.uint8, device=k.device).set_(storage)
    return None


def write_header(buf: torch.Tensor, header: LayerHeader) -> None:
    """Write ``header`` into the message buffer ``buf`` (any device). ``buf`` may be an inference
    tensor (the engine's forward takes message buffers in inference mode) written after it, e.g.
    the last layer's, framed after sampling: in-place writes to one need inference mode."""
    raw = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    with torch.inference_mode():
        if buf.is_cuda:
            # From page-locked memory, in stream order: a copy from pageable memory waits for
            # the device to finish everything queued before it (at every layer of a prefill that
            # sends its KV). torch's pinned-memory cache keeps ``pinned`` until the copy has run.
            pinned = torch.empty(HEADER_NBYTES, dtype=torch.uint8, pin_memory=True).copy_(raw)
            buf[:HEADER_NBYTES].copy_(pinned, non_blocking=True)
        else:
            buf[:HEADER_NBYTES].copy_(raw)


def write_message(buf: torch.Tensor, header: LayerHeader, k: torch.Tensor, v: torch.Tensor) -> int:
    """Frame ``header``, ``k`` and ``v`` into the uint8 tensor ``buf`` (copying K and V);
    returns the message length."""
    k_view, v_view = message_views(buf, header)
    with torch.inference_mode():  # see write_header
        k_view.copy_(k)
        v_view.copy_(v)
    write_header(buf, header)
    return HEADER_NBYTES + 2 * k.numel() * k.element_size()


def read_header(buf: torch.Tensor) -> LayerHeader:
    head = buf[:HEADER_NBYTES]
    if head.is_cuda:
        head = head.cpu()
    return LayerHeader.unpack(head.numpy().data)


def header_view(buf: torch.Tensor) -> memoryview | None:
    """The header bytes of the CPU message buffer ``buf`` as a writable memoryview (made once per
    buffer: ``LayerHeader.unpack`` reads it, ``pack`` output can be assigned to it), else None."""
    if buf.is_cuda:
        return None
    return memoryview(buf.numpy())[:HEADER_NBYTES]
