"""How long an engine step should take on this worker, learned from its own recent steps.

The gateway's hang watchdog (services/gateway/watchdog.py) takes a worker whose current step has
run several times longer than predicted for stuck. The prediction must never be short for a
healthy step, so it is an upper estimate built from two facts about a forward pass:

- a step of more tokens does not take less time (cost is monotone in tokens);
- a token does not cost more in a bigger step (the fixed part of a step, reading the weights,
  is shared by more tokens).

So a measured step of ``t`` tokens that took ``s`` seconds bounds a step of ``n`` tokens by
``s * max(1, n / t)``, and the prediction is the tightest such bound among the recent steps.
Workers measure steps before they serve (``EngineLoop._warm_up``). Before any step has been
measured (an engine used without that warm-up) it is
``UNMEASURED_STEP_S + n * UNMEASURED_S_PER_TOKEN``: long enough that the gateway leaves such a
step to its slower probes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 64  # recent steps the prediction is made from (contexts change slowly across them)
UNMEASURED_STEP_S = 10.0
UNMEASURED_S_PER_TOKEN = 0.05


@dataclass(frozen=True)
class EngineProgress:
    """What a worker says about its engine thread (WorkerStats fields 6-8).

    ``num_steps``: steps completed since start; ``busy_s``: seconds its current piece of work
    (commands and the step after them) has run, 0 while idle; ``predicted_s``: how long the
    current step should take (``StepCost.predict``), 0 until it is scheduled (commands only)."""

    num_steps: int
    busy_s: float
    predicted_s: float


class StepCost:
    """``observe`` from the engine thread after each step; ``predict`` from any thread."""

    def __init__(self, window: int = WINDOW) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._lock = threading.Lock()

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            with self._lock:
                self._recent.append((num_tokens, seconds))

    def predict(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` should take at most (the module docstring's rule)."""
        with self._lock:
            recent = tuple(self._recent)
        if not recent:
            return UNMEASURED_STEP_S + num_tokens * UNMEASURED_S_PER_TOKEN
        return min(s * max(1.0, num_tokens / t) for t, s in recent)
