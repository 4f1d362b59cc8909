"""Compile a C kernel source once per machine into a cached shared library and load it.

The library lands in ``envs.cache_dir()/kernels/<key>/<name>.so`` where the key hashes the source
and the headers beside it, the flags, the compiler's version and the machine (``-march=native``
code runs only where it was built). Compilation writes a temporary file in the same folder and
``os.replace``s it into place, so processes racing to build the same library each produce a
complete file and the last one wins.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve import envs

_BASE_FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")
# What each PDSERVE_CPU_ISA takes away from -march=native (envs.cpu_isa): every library is built
# with it, so an AVX-512 machine runs the code an AVX2 (or a plain x86-64) machine runs.
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx",)}
# Tried in order: with OpenMP, then (e.g. Apple clang) single-threaded but still in place.
FLAG_SETS = (_BASE_FLAGS + ("-fopenmp",), _BASE_FLAGS)


class BuildError(RuntimeError):
    """The C kernel could not be compiled or loaded; the message says why in one line."""


def _compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    raise BuildError("no C compiler (cc, gcc or clang) on PATH")


def _machine_id() -> str:
    """The CPU the code is tuned for: architecture and, on Linux, its feature flags."""
    features = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    features = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{features}"


def _library_path(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what it may include
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), version.encode()):
        key.update(part)
        key.update(b"\0")
    key.update(_machine_id().encode())
    return envs.cache_dir() / "kernels" / key.hexdigest()[:16] / f"{source.stem}.so"


def _compile(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}.", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, str(source), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
            raise BuildError(f"{Path(compiler).name} failed: {lines[-1]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Load ``source`` compiled for this machine, compiling it first if it is not cached.

    ``extra_flags`` go after the standard ones (and into the cache key), e.g. ``-U__AVX2__``
    to build a kernel's portable path; ``PDSERVE_CPU_ISA``'s flags (``ISA_FLAGS``) go last.
    """
    compiler = _compiler()
    reasons = []
    tail = tuple(extra_flags) + tuple(f for f in ISA_FLAGS[envs.cpu_isa()] if f not in extra_flags)
    for flags in (f + tail for f in FLAG_SETS):
        try:
            target = _library_path(source, compiler, flags)
            if not target.exists():
                _compile(source, compiler, flags, target)
            return ctypes.CDLL(str(target))
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            reasons.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    raise BuildError("; ".join(reasons))
