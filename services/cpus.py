"""Workers' cores: ``--cpus`` (pin the process) and ``--borrow-cpus`` (the cores of the other
role's worker beside it, which its engine's steps also use while that worker is idle;
pdserve/engine_loop.py EngineLoop._borrow)."""

from __future__ import annotations

import argparse
import os

BORROW_HELP = {
    "decode": "the cores of a prefill worker on this machine (e.g. 0 or 0,1): this worker's steps "
    "also use them while no KV is on its way to it (that worker is idle); pdserve up sets it",
    "prefill": "the cores of a decode worker on this machine (e.g. 1): this worker's steps also "
    "use them while each prompt they compute is for an idle decode worker (the gateway says "
    "which); pdserve up sets it",
}


def cpu_list(text: str) -> frozenset[int]:
    """Cores written ``0`` or ``0,1`` (``--cpus``, ``--borrow-cpus``)."""
    try:
        cpus = frozenset(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cores are written as numbers separated by commas, e.g. 0 or 0,1; got {text!r}"
        ) from None
    if any(c < 0 for c in cpus):
        raise argparse.ArgumentTypeError(f"core numbers are >= 0, got {text!r}")
    return cpus


def add_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--cpus", type=cpu_list, default=frozenset(), help="pin to these cores, e.g. 0 or 0,1"
    )
    if role in BORROW_HELP:
        p.add_argument(
            "--borrow-cpus",
            type=cpu_list,
            default=frozenset(),
            metavar="CPUS",
            help=BORROW_HELP[role],
        )


def usable_cpus() -> frozenset[int]:
    """The cores this machine lets a process run on: its cgroup's cpuset where it has one (a
    container's), else every online core. Not this process's own affinity: a launcher pinned to
    one core (bench/gateway_overhead.py pins itself beside its gateway) passes that on, and the
    worker it starts may still pin itself to another core."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            cpus: set[int] = set()
            for part in text.split(","):
                first, _, last = part.partition("-")
                cpus.update(range(int(first), int(last or first) + 1))
            return frozenset(cpus)
    return frozenset(range(os.cpu_count() or 1))


def pin(cpus: frozenset[int], borrow: frozenset[int], threads: int | None = None) -> None:
    """Pin this process to ``cpus`` (none: as it is); SystemExit, saying which, when either set
    names a core this machine does not let it run on, or when ``threads`` (the engine's) are
    more than ``cpus`` has cores."""
    if cpus and threads is not None and threads > len(cpus):
        raise SystemExit(
            f"--threads {threads} is more than the {len(cpus)} core(s) of --cpus "
            f"{','.join(map(str, sorted(cpus)))}: threads that share a core wait for each other "
            "at every step's barriers (a step ~35x slower, measured); give --cpus a core per "
            "thread, or fewer threads"
        )
    usable = usable_cpus()
    for option, wanted in (("--cpus", cpus), ("--borrow-cpus", borrow)):
        if not wanted <= usable:
            raise SystemExit(
                f"{option}: core(s) {','.join(map(str, sorted(wanted - usable)))} are not among "
                f"those this process may run on ({','.join(map(str, sorted(usable)))})"
            )
    if cpus:
        os.sched_setaffinity(0, cpus)
