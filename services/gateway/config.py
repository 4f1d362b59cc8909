"""The gateway's settings: one frozen dataclass, its defaults the only ones (the CLI reads them)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("cost", "least_loaded", "round_robin")  # router.py; the first is the default


@dataclass(frozen=True)
class GatewayConfig:
    """``policy``: how workers are picked (``POLICIES``, router.py); ``lease_s``: how long a
    worker stays listed without a heartbeat; ``kv_timeout_s``: how long a decode worker holds
    blocks reserved for a KV transfer beyond twice the wait expected at its prefill worker
    (``cost.kv_hold_s``), and the prefill call's deadline when the client set none;
    ``max_attempts``: worker pairs tried before the first token; ``max_resumes``: how many times
    a request whose worker fails after tokens were streamed is continued on another worker (its
    prompt plus the tokens sent so far as the new prompt), then UNAVAILABLE; ``queue_timeout_s``: how long a
    request without a deadline waits while every decode worker is full; ``outage_wait_s``: how
    long a request waits when no worker is left for it to try (the workers are restarting, or
    were evicted and not back yet) — if the cluster had a serving path within that long; a
    gateway that never had one, or lost it longer ago, answers UNAVAILABLE at once (0: never
    waits); ``api_keys_file``: the
    JSON file of hashed API keys and their limits (``pdserve keys add``), read again on SIGHUP;
    None: the keys in $PDSERVE_API_KEYS, else none (the gateway is open).
    ``local_prefill_tokens``, ``decode_prefill_budget_s``, ``decode_prefill_max_tokens`` and
    ``decode_prefill_share``: when a decode worker prefills a prompt itself instead of a prefill
    worker (``placement.py``); a budget of 0 always disaggregates, a share of 1 lets the prompts
    taken on for a busy prefill worker come as closely as the budget allows.
    ``affinity_slack_s``: policy ``cost`` sends a request with an affinity key to the prefill worker its key hashes to while that one's estimate is at
    most this many seconds above the cheapest's. ``warm_replies``: a disaggregated request's
    reply is sent to its prefill worker, once finished, to keep in its prefix cache (warm.py).

    Hang detection (``watchdog.py``): each worker gets a fast probe (Stats, ``probe_timeout_s``)
    every ``probe_interval_s`` (0 turns the watchdog off) and a real one (a 1-token generation)
    every ``real_probe_interval_s``, both at once when it has calls running and no message from
    it for ``suspect_after_s``. A failed fast probe (the process does not answer) is confirmed by
    a real probe given ``real_probe_timeout_s``; a worker whose process answers gets
    ``engine_timeout_s`` for its real probe (longer than two chunked-prefill steps). Failing,
    and nothing arrived from it meanwhile: evicted. A stopped worker is evicted at most
    max(suspect_after_s, probe_interval_s) + 0.25 + probe_timeout_s + real_probe_timeout_s after
    its last progress (4.25 s by default).

    A worker whose engine alone is stuck (it still answers Stats) is caught by Stats' engine
    progress: its current step has run longer than max(``stuck_step_floor_s``,
    ``stuck_step_factor`` x the time the worker predicts for that step from its own recent
    steps, pdserve/step_cost.py). The watchdog asks again when a running step would reach that
    bound, so such a worker is evicted at most bound + 0.25 s + a Stats round trip after the
    step began: 2.25 s and a few ms by default for a step predicted at 0.5 s or less (commands
    and decode steps). A step predicted longer than 0.25 s (a CPU prefill chunk of seconds)
    marks each layer done, and what is bounded is then the time since the last mark against a
    layer's share of the prediction: 2.25 s too, however long the step. Any of prefill, decode and colocated
    workers; the real probe (``engine_timeout_s``) stays the backstop. Workers warm up before
    they serve (EngineLoop._warm_up), so a prediction is measured before the first request."""

    policy: str = POLICIES[0]
    lease_s: float = 10.0
    kv_timeout_s: float = 30.0
    max_attempts: int = 3
    max_resumes: int = 3
    queue_timeout_s: float = 300.0
    outage_wait_s: float = 30.0
    api_keys_file: str | None = None
    local_prefill_tokens: int = 32
    decode_prefill_budget_s: float = 0.5
    decode_prefill_max_tokens: int = 1024
    decode_prefill_share: float = 0.15
    probe_interval_s: float = 1.0
    real_probe_interval_s: float = 5.0
    suspect_after_s: float = 1.0
    probe_timeout_s: float = 1.0
    real_probe_timeout_s: float = 2.0
    engine_timeout_s: float = 20.0
    stuck_step_floor_s: float = 2.0
    stuck_step_factor: float = 4.0
    affinity_slack_s: float = 0.5
    warm_replies: bool = False

    def __post_init__(self) -> None:
        if not self.probe_interval_s >= 0:
            raise ValueError(
                f"probe_interval_s must be >= 0 seconds (0: no hang detection), "
                f"got {self.probe_interval_s}"
            )
        for name in (
            "lease_s",
            "kv_timeout_s",
            "queue_timeout_s",
            "real_probe_interval_s",
            "suspect_after_s",
            "probe_timeout_s",
            "real_probe_timeout_s",
            "engine_timeout_s",
            "stuck_step_floor_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.stuck_step_factor >= 1:
            raise ValueError(
                f"stuck_step_factor must be >= 1 (a multiple of a step's predicted time), "
                f"got {self.stuck_step_factor}"
            )
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if not isinstance(self.local_prefill_tokens, int) or self.local_prefill_tokens < 0:
            raise ValueError(
                f"local_prefill_tokens must be an integer >= 0, got {self.local_prefill_tokens!r}"
            )
        if not self.outage_wait_s >= 0:
            raise ValueError(
                f"outage_wait_s must be >= 0 seconds (0: never waits), got {self.outage_wait_s}"
            )
        if not self.decode_prefill_budget_s >= 0:
            raise ValueError(
                f"decode_prefill_budget_s must be >= 0 seconds, got {self.decode_prefill_budget_s}"
            )
        if (
            not isinstance(self.decode_prefill_max_tokens, int)
            or self.decode_prefill_max_tokens < 0
        ):
            raise ValueError(
                "decode_prefill_max_tokens must be an integer >= 0, got "
                f"{self.decode_prefill_max_tokens!r}"
            )
        if not 0 < self.decode_prefill_share <= 1:
            raise ValueError(
                "decode_prefill_share must be a fraction in (0, 1] (the most of a decode "
                "worker's time, while it runs streams, that prompts it takes on for a busy "
                f"prefill worker may take; 1: no limit), got {self.decode_prefill_share}"
            )
        if not self.affinity_slack_s >= 0:
            raise ValueError(f"affinity_slack_s must be >= 0 seconds, got {self.affinity_slack_s}")
        if not isinstance(self.max_resumes, int) or self.max_resumes < 0:
            raise ValueError(f"max_resumes must be an integer >= 0, got {self.max_resumes!r}")
