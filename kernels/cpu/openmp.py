"""One OpenMP master thread per process: the idle thread pool a thread leaves behind, released.

GNU OpenMP keeps a pool of worker threads per thread that has opened a parallel region (and
waits differently at barriers once a process holds more OpenMP threads than CPUs). A worker loads
and warms up its engine in the main thread, which leaves that thread's pool behind (idle, but
counted); the engine thread then opens its own, and its steps slowed down: measured on a 2-core
AVX2 Zen 3, the default model's batch-1 decode step (Q4_1, 2 threads, 700-token context) took
24.7 ms when run from a second thread against 13.3 ms with the first thread's pool released, the
same as stepping in the main thread. ``release_thread_pool`` ends the calling thread's pool
(``omp_pause_resource_all(omp_pause_hard)``, OpenMP 5.0); the next parallel region of that thread
would start a new one.
"""

from __future__ import annotations

import ctypes
import functools

_OMP_PAUSE_HARD = 2


@functools.cache
def _pause_all():
    """``omp_pause_resource_all`` of the OpenMP runtime the kernels share with torch, or None."""
    for name in ("libgomp.so.1", "libgomp.so"):
        try:
            fn = ctypes.CDLL(name).omp_pause_resource_all  # the one already loaded, by soname
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_thread_pool() -> bool:
    """End the calling thread's idle OpenMP worker threads; False where the runtime cannot
    (not GNU OpenMP, or older than OpenMP 5.0), which changes nothing but speed."""
    fn = _pause_all()
    return fn is not None and fn(_OMP_PAUSE_HARD) == 0
