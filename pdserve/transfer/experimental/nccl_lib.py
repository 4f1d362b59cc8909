"""libnccl.so.2 through ctypes: the few calls the NCCL KV transport uses.

Where the library comes from: the ``nvidia-nccl-cu12`` wheel ships ``nvidia/nccl/lib/libnccl.so.2``
(and headers, no Python); ``find_libnccl`` returns that path, or plain ``libnccl.so.2`` so that
the dynamic loader searches the system (LD_LIBRARY_PATH, ld.so.cache) when the wheel is absent.
On a machine without a GPU driver ``ncclGetVersion`` and ``ncclGetUniqueId`` work; creating a
communicator does not.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
NCCL_UINT8 = 1  # ncclDataType_t ncclUint8
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7


class NCCLError(RuntimeError):
    pass


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def find_libnccl() -> str:
    """The wheel's libnccl.so.2 if installed, else the name for the system loader to find."""
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "lib" / "libnccl.so.2"
        if path.exists():
            return str(path)
    return "libnccl.so.2"


class NCCLLibrary:
    def __init__(self, path: str | None = None) -> None:
        self.path = path or find_libnccl()
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise NCCLError(
                f"cannot load {self.path}: {exc}; install nvidia-nccl-cu12 or put libnccl.so.2 "
                "on the loader's path"
            ) from exc
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        signatures = {
            "ncclGetVersion": [ctypes.POINTER(i)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(vp), i, UniqueId, i],
            "ncclCommDestroy": [vp],
            "ncclCommAbort": [vp],
            "ncclCommGetAsyncError": [vp, ctypes.POINTER(i)],
            "ncclSend": [vp, sz, i, i, vp, vp],
            "ncclRecv": [vp, sz, i, i, vp, vp],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, i
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
        self._lib = lib

    def _check(self, name: str, result: int) -> None:
        if result != NCCL_SUCCESS:
            text = self._lib.ncclGetErrorString(result).decode()
            raise NCCLError(f"{name} failed: {text} (ncclResult_t {result})")

    def version(self) -> tuple[int, int, int]:
        code = ctypes.c_int()
        self._check("ncclGetVersion", self._lib.ncclGetVersion(ctypes.byref(code)))
        major, rest = divmod(code.value, 10000)  # NCCL >= 2.9 encodes x.yy.zz as x*10000+yy*100+zz
        return major, rest // 100, rest % 100

    def unique_id(self) -> bytes:
        """A fresh communicator id: created by one rank, sent to the others (over gRPC here)."""
        uid = UniqueId()
        self._check("ncclGetUniqueId", self._lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid)  # all 128 bytes (the field itself would stop at a NUL)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Blocks until all ``nranks`` ranks have joined. Needs a GPU (the current device)."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId.from_buffer_copy(unique_id)
        comm = ctypes.c_void_p()
        self._check(
            "ncclCommInitRank", self._lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank)
        )
        return comm.value or 0

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._check("ncclSend", self._lib.ncclSend(ptr, nbytes, NCCL_UINT8, peer, comm, stream))

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._check("ncclRecv", self._lib.ncclRecv(ptr, nbytes, NCCL_UINT8, peer, comm, stream))

    def async_error(self, comm: int) -> int:
        result = ctypes.c_int()
        self._check(
            "ncclCommGetAsyncError", self._lib.ncclCommGetAsyncError(comm, ctypes.byref(result))
        )
        return result.value

    def abort(self, comm: int) -> None:
        """Ends a communicator from any thread, unblocking operations stuck on a dead peer."""
        self._check("ncclCommAbort", self._lib.ncclCommAbort(comm))

    def destroy(self, comm: int) -> None:
        self._check("ncclCommDestroy", self._lib.ncclCommDestroy(comm))
