"""Keep the processes of ``pdserve up`` running: one that exits is started again with the same
command, after a backoff (1, 2, 4, ... 30 s; back to 1 s once it has stayed up a minute), so a
local cluster heals itself. A restarted worker registers with the gateway like a new one; a
restarted gateway comes back on the same ports and the workers register again on their next
heartbeat (they re-register when the gateway does not know them).

Exit code 2 is not retried: pdserve exits with it when its configuration is refused (bad flags, a
key file it cannot read, a registration the gateway refuses), and the same command would fail
again. ``pdserve up`` then stops the whole cluster, saying why.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_AFTER_S = 60.0  # up this long: the next exit starts the backoff over
FATAL_EXIT = 2


class FatalExit(RuntimeError):
    """A supervised process exited with FATAL_EXIT; the message says which and how."""


class ExitedBeforeReady(RuntimeError):
    """The process exited (with ``code``) before it said it was ready."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Supervised:
    name: str  # "gateway", "decode-0", ...
    argv: list[str]  # pdserve <argv>
    proc: subprocess.Popen
    started_at: float
    failures: int = 0  # exits in a row, each within HEALTHY_AFTER_S of its start
    restarts: int = 0
    restart_at: float | None = None  # set while it is down, waiting out its backoff


class Supervisor:
    """``start(argv) -> (Popen, ready-line extras)`` starts a process and waits until it is ready
    (``launcher.start_process``); ``poll()``, called every half second or so, restarts what has
    exited once its backoff has passed."""

    def __init__(self, start: Callable[[list[str]], tuple[subprocess.Popen, str]]) -> None:
        self._start = start
        self.processes: list[Supervised] = []

    def add(self, name: str, argv: list[str], proc: subprocess.Popen) -> None:
        self.processes.append(Supervised(name, argv, proc, time.monotonic()))

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [s.proc for s in self.processes]

    def poll(self) -> None:
        """Notice exits and restart due processes; FatalExit when one exited with code 2."""
        now = time.monotonic()
        for s in self.processes:
            if s.restart_at is None:
                code = s.proc.poll()
                if code is not None:
                    self._down(s, f"exited with code {code}", now, code)
            elif now >= s.restart_at:
                self._restart(s)

    def _down(self, s: Supervised, why: str, now: float, code: int | None = None) -> None:
        if code == FATAL_EXIT:
            raise FatalExit(f"{s.name} {why} (its configuration was refused): not restarting it")
        if now - s.started_at >= HEALTHY_AFTER_S:
            s.failures = 0
        delay = BACKOFF_S[min(s.failures, len(BACKOFF_S) - 1)]
        s.failures += 1
        s.restart_at = now + delay
        print(
            f"pdserve up: {s.name} {why}; restarting it in {delay:g} s", file=sys.stderr, flush=True
        )

    def _restart(self, s: Supervised) -> None:
        try:
            s.proc, extras = self._start(s.argv)
        except ExitedBeforeReady as e:
            self._down(s, f"did not start ({e})", time.monotonic(), e.code)
            return
        s.started_at = time.monotonic()
        s.restart_at = None
        s.restarts += 1
        print(
            f"pdserve up: {s.name} restarted (pid {s.proc.pid}, restart {s.restarts}){extras}",
            flush=True,
        )
