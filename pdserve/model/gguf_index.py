"""A GGUF file's tensor index, read straight from its header.

A worker that runs a GGUF's own quantized blocks needs only where each tensor lies. The ``gguf``
package's reader also decodes every metadata value, the tokenizer's ~100,000 strings one numpy
view at a time: ~4 s of a worker's start on a 2-core machine, for fields the worker never reads
(the converted model folder holds the config and the tokenizer). This walks the header's metadata
without decoding it and returns the tensors' names, types, shapes and byte ranges.

The layout (GGUF versions 2 and 3, little-endian): the magic ``GGUF``, the version (u32), the
tensor count and the metadata count (u64 each); the metadata, each a key (a string: u64 length,
then bytes), a value type (u32) and the value (a scalar, a string, or an array: element type
(u32), count (u64), elements); then one entry per tensor: its name, the number of dimensions
(u32), the dimensions (u64 each, the fastest-varying first), the GGML type (u32) and the offset
(u64) from the start of the data, which begins at the next multiple of ``general.alignment``
(32 unless the metadata says otherwise) after the last entry.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# metadata value type -> size in bytes of a scalar of it (8 = string and 9 = array are walked)
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# GGML type id -> (values per block, bytes per block), for the types whose size is known here
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 30: (1, 2)}


class GGUFIndexError(ValueError):
    """The file is not a GGUF this reader understands; the message says what was found."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # as the file lists it: fastest-varying first ([in, out] for a matrix)
    tensor_type: int  # GGML's type id
    start: int  # byte offset in the file
    nbytes: int | None  # None for a type whose block size is not in ``BLOCKS``

    def read(self, path: Path) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 tensor (a copy, not a view of the file)."""
        if self.nbytes is None:
            raise GGUFIndexError(f"{self.name}: GGML type {self.tensor_type} has no known size")
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(self.start)
            if f.readinto(out.numpy()) != self.nbytes:
                raise GGUFIndexError(f"{path}: {self.name} runs past the end of the file")
        return out


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFIndexError(f"{self.path}: the header ends early (at byte {self.pos})")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (n,) = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFIndexError(f"{self.path}: a string runs past the end (at byte {self.pos})")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in SCALAR_BYTES:
            self.pos += SCALAR_BYTES[vtype]
        elif vtype == STRING:
            (n,) = self.take("<Q")
            self.pos += n
        elif vtype == ARRAY:
            etype, count = self.take("<IQ")
            if etype in SCALAR_BYTES:
                self.pos += SCALAR_BYTES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise GGUFIndexError(f"{self.path}: unknown metadata value type {vtype}")
        if self.pos > len(self.buf):
            raise GGUFIndexError(f"{self.path}: the metadata runs past the end of the file")


def read_index(path: Path) -> list[TensorEntry]:
    """The tensors of the GGUF file at ``path``, in the file's order."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFIndexError(f"{path}: not a GGUF file (it does not start with b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                return _entries(_Cursor(buf, path), path, len(mm))
            finally:
                buf.release()


def _entries(cur: _Cursor, path: Path, size: int) -> list[TensorEntry]:
    cur.pos = 4
    (version,) = cur.take("<I")
    if version not in VERSIONS:
        raise GGUFIndexError(
            f"{path}: GGUF version {version}; this reader knows versions "
            f"{', '.join(map(str, VERSIONS))} (little-endian)"
        )
    n_tensors, n_meta = cur.take("<QQ")
    alignment = 32
    for _ in range(n_meta):
        key = cur.string()
        (vtype,) = cur.take("<I")
        if key == "general.alignment" and vtype == 4:
            (alignment,) = cur.take("<I")
        else:
            cur.skip_value(vtype)
    if alignment <= 0:
        raise GGUFIndexError(f"{path}: general.alignment is {alignment}; it must be positive")
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        (ndim,) = cur.take("<I")
        shape = cur.take(f"<{ndim}Q")
        ttype, offset = cur.take("<IQ")
        raw.append((name, shape, ttype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    out = []
    for name, shape, ttype, offset in raw:
        nbytes = None
        if ttype in BLOCKS:
            per_block, block_bytes = BLOCKS[ttype]
            count = 1
            for d in shape:
                count *= d
            nbytes = count // per_block * block_bytes
        start = data_start + offset
        if start + (nbytes or 0) > size:
            raise GGUFIndexError(f"{path}: tensor {name} runs past the end of the file")
        out.append(TensorEntry(name, tuple(shape), ttype, start, nbytes))
    return out
