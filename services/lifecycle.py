"""Defaults of the servers' health and shutdown (light: the CLI reads them without loading the
engine). See services/main.py and docs/architecture.md ("Health and drain")."""

from __future__ import annotations

# On SIGTERM a server stops taking requests and gives the running ones this long to finish.
DRAIN_TIMEOUT_S = 30.0
# A worker whose engine thread spends this long in one command or step is unhealthy: it says
# NOT_SERVING and deregisters until the step ends. A CPU step takes milliseconds to a few seconds.
STALL_TIMEOUT_S = 30.0

# The request id prefix of the gateway's real probes (services/gateway/watchdog.py): a decode or
# colocated worker serves them like any request but does not count, log or trace them.
PROBE_PREFIX = "probe-"


def check(drain_timeout_s: float, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
    """ValueError (a clear message for the CLI) unless the bounds make sense."""
    if not drain_timeout_s >= 0:
        raise ValueError(f"drain timeout must be >= 0 seconds, got {drain_timeout_s}")
    if not stall_timeout_s > 0:
        raise ValueError(f"stall timeout must be > 0 seconds, got {stall_timeout_s}")
