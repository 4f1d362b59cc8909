"""Conditional disaggregation: whether a request's prompt is prefilled by a prefill worker (and its
KV shipped) or by the decode worker itself, decided per request.

A prefill worker is worth its transfer when it is free: the decode worker's running streams then
never wait for a prompt. When the prefill workers are the bottleneck (long prompts, one prefill
core), a prompt queued there waits longer than the decode worker would take to prefill it, and
the decode worker's core idles meanwhile. So a request is prefilled on its decode worker when

- what it would compute of the prompt is short (``local_prefill_tokens``): the hop and the
  transfer cost more than the prefill, and a few tokens fit beside a decode step; or
- it runs nothing of this gateway's (no stream, no prompt: there is no TPOT to protect) and
  holds more of the prompt than the prefill worker (``HELD_HERE``): a chat's next turn finds
  the last reply there, which no prefill worker ever computed, so the prefill worker would
  compute more and then ship it; or
- the prefill worker's queue would hold it longer than the prefills this decode worker has taken
  on (this one included) take, ``h`` seconds, and the decode worker is starved: the ``P``
  prompts waiting at the prefill worker are at least ``STARVED`` (2) per stream it runs (``S``,
  counting the prompts it is prefilling itself: they are streams the next one holds back), and
  the time that holds its streams back is paid for by those prompts: ``S·h ≤
  decode_prefill_budget_s · P`` (S at least 1). The budget is how long each waiting prompt may
  hold the decode worker's streams back. P and S are this gateway's requests there; both tests
  are homogeneous in them, so gateways that share the load evenly decide as one would. When
  prefill keeps up, its queue is empty and every prompt goes there. When it is the bottleneck
  with a decode batch that stays small (long prompts on one prefill core: tens waiting, a few
  streams), both cores prefill and the batch fills; while the batch is as large as half the
  queue, no prompt beyond a short one holds it back, and its TPOT stays protected. The factor 2
  is measured, not derived: on a 2-core Zen 3 at placement time, P/S was 2-8 under W-c32 (32
  users, long prompts: prefill-bound, and the decode core's prefills raise throughput) and 1-2
  under W-mixed (mostly short prompts behind a few long ones: its prefills only hold streams
  back). (Until 2026-11-28 the rule was ``h ≤
  budget`` whatever S and P: a budget small enough for W-mixed's TPOT left W-c32's decode
  worker running batches of ~3, one large enough for W-c32 held W-mixed's batches back;
  docs/benchmarks.md, "One placement rule for both loads".) And while it runs streams, a decode
  worker takes on no prompt longer than ``decode_prefill_max_tokens`` (1,024: the engine's
  default prefill chunk) this way: the budget rule weighs a prompt's whole stall against the
  queue it saves, and one prompt of 2,000 tokens on a deep queue passed it, held every stream
  back for seconds (~4 s on one Xeon core) and set W-mixed's TPOT p99 (docs/benchmarks.md,
  "Weights on huge pages"). Nor do such prompts (``PREFILL_BUSY``) take more than
  ``decode_prefill_share`` of a decode worker's time while it runs streams: after one that its
  rate says takes h seconds there, it takes no other for h / share seconds (a token bucket that
  keeps no credit), so they come spread out, not bunched. Bunched is how they came while one
  long prompt held the prefill worker for seconds and the short ones behind it went to the
  decode worker one after another: the streams that lived through such a bunch set W-mixed's
  TPOT p99 (docs/benchmarks.md, "The decode worker's own prefills, spread out"). Except while
  the prefill worker holds at least ``DEEP`` (4) prompts per stream (P ≥ 4·S): a decode batch
  that small is what the share kept it at under W-c32 (32 users, long prompts on one prefill
  core: ~3 streams, each token ~1.3x the core time it costs in a batch of 10), and W-mixed's
  placements come at P/S of 1-2. There it takes them as the budget allows, and its batch grows
  (on a 2-core Zen 4: W-c32 0.96-0.99x colocated's throughput, was 0.90-0.93x; W-mixed's TPOT
  p99 0.40-0.42x colocated's, was 0.34-0.37x; docs/benchmarks.md, "Prefetching into L2").

Work is counted in prompt tokens to compute: a prompt less the leading blocks the worker is
expected to hold (``cost.tokens_to_compute``: its heartbeat's prefix summary and what this gateway
sent there lately); a prompt whose prefix the decode worker holds (decode-side prefix reuse) is
cheap to prefill there. Times come from one rate per prefill worker: prompt tokens computed per
second while this gateway's prompts keep it busy (``record_prefill``). (Counted in whole prompts,
as until 2026-11-27, the cache hits made the rate look several times faster than computing is,
and a cold prompt looked that much cheaper to prefill on the decode worker.) The queue is
counted whole, as if the prefill worker computed its prompts in arrival order: with the shortest
first (its default ``--prompt-order``) a short prompt waits less than that, so the decode worker
may take one on that would soon have been computed there; the share rule bounds how often.
A decode worker is assumed to prefill at the rate of the prefill worker it would have used (same
model; the roles run the same engine). Until this gateway has measured a rate, the prefill
worker's own is used (``prefill_token_s`` in its heartbeats, measured by its engine from its
warm-up on); without either, only the short-prompt rule applies. ``decode_prefill_budget_s`` 0
turns the whole thing off: always disaggregate.
"""

from __future__ import annotations

from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.cost import Job, measured_token_s, now, tokens_to_compute
from pdserve.services.gateway.registry import Worker

RATE_WEIGHT = 0.2  # of a new measurement in the average
# A decode worker is starved (may prefill beyond a short prompt) while the prefill worker holds
# at least this many prompts per stream it runs
STARVED = 2
# ... and takes them on without waiting out the share (``decode_prefill_share``) while at least
# this many wait per stream
DEEP = 4

SHORT_PROMPT = "short_prompt"
HELD_HERE = "held_here"
PREFILL_BUSY = "prefill_busy"
DISAGGREGATED = "disaggregated"


def prefill_started(prefill: Worker, at: float) -> None:
    """A prefill call of this gateway's went out to ``prefill`` at ``at`` (time.perf_counter()):
    the worker is busy with this gateway's prompts from then, if it was not already."""
    if not prefill.prefills_running:
        prefill.prefill_busy_from = at
    prefill.prefills_running += 1


def record_prefill(prefill: Worker, tokens: int | None, at: float) -> None:
    """A prefill call ``prefill_started`` ended at ``at``, having computed ``tokens`` (None: it
    failed). The worker's rate is the prompt tokens its prefills computed over the time they kept
    it busy: each that ends counts the time since the previous one ended (or since it was sent,
    if none was running), and the rate is the ratio of exponential averages of both. Not a
    prompt's tokens and those queued ahead of it over its own duration, as until 2026-11-30: a
    worker computes the shortest prompts first (``--prompt-order``), so a short one passes the
    queue and a long one waits for later ones, and that measure read several times the real
    rate (most prompts are the short ones)."""
    prefill.prefills_running -= 1
    seconds, prefill.prefill_busy_from = at - prefill.prefill_busy_from, at
    if tokens is None:
        return
    avg = prefill.prefill_averages
    if not avg:
        avg[:] = [tokens, seconds]
    else:
        avg[0] += RATE_WEIGHT * (tokens - avg[0])
        avg[1] += RATE_WEIGHT * (seconds - avg[1])
    if avg[0] > 0 and avg[1] > 0:
        prefill.prefill_rate = avg[0] / avg[1]


def decode_idle(decode: Worker, cost: int) -> bool:
    """Whether the request of ``cost`` (prompt + max_tokens) just admitted on ``decode`` is all
    this gateway runs there: its prefill worker may then borrow that worker's cores
    (PrefillRequest.decode_idle; EngineLoop._borrow). Other gateways' requests are not known."""
    return decode.outstanding_tokens == cost and not decode.local_prefill_tokens


def weighed(prefill: Worker, decode: Worker) -> dict:
    """P and S of ``decide`` (router.pick's attributes): this gateway's prompts at the prefill
    worker; its streams at the decode worker, with the prompts it is prefilling itself (streams
    the next one holds back)."""
    return {"prefill_prompts": prefill.prompts, "decode_streams": decode.streams + decode.prompts}


def place(job: Job, prefill: Worker, decode: Worker, cfg: GatewayConfig, stale_s: float) -> str:
    """``decide`` for ``job``, from the prompt tokens each worker is expected to compute; a
    PREFILL_BUSY prompt is ``spread``."""
    t = now()
    here, there = (tokens_to_compute(w, job, t, stale_s) for w in (decode, prefill))
    reason = decide(here, prefill, decode, cfg, there, t)
    if reason == PREFILL_BUSY:
        spread(here, prefill, decode, cfg, t)
    return reason


def spread(num_tokens: int, prefill: Worker, decode: Worker, cfg: GatewayConfig, t: float) -> None:
    """``decode`` takes on a prompt of ``num_tokens`` because ``prefill`` is busy, at time ``t``:
    while it runs streams, it takes no other such prompt until ``num_tokens`` at ``prefill``'s
    rate, divided by ``decode_prefill_share``, has passed (1: no wait)."""
    if cfg.decode_prefill_share < 1 and weighed(prefill, decode)["decode_streams"]:
        decode.prefill_busy_until = t + num_tokens / _rate(prefill) / cfg.decode_prefill_share


def _rate(prefill: Worker) -> float | None:
    """Prompt tokens per second at ``prefill``: what this gateway measured there, else what the
    worker reports, else None."""
    if prefill.prefill_rate:
        return prefill.prefill_rate
    token_s = measured_token_s(prefill, prefill.report)
    return None if token_s is None else 1.0 / token_s


def decide(
    num_tokens: int,
    prefill: Worker,
    decode: Worker,
    cfg: GatewayConfig,
    there: int | None = None,
    t: float | None = None,
) -> str:
    """SHORT_PROMPT, HELD_HERE or PREFILL_BUSY (prefill on ``decode``), or DISAGGREGATED.
    ``num_tokens``: the prompt tokens ``decode`` would compute; ``there``: those ``prefill``
    would (None: as many); ``t``: now (None: the clock's)."""
    if cfg.decode_prefill_budget_s <= 0:
        return DISAGGREGATED
    if num_tokens <= cfg.local_prefill_tokens:
        return SHORT_PROMPT
    if there is not None and num_tokens < there and not (decode.streams or decode.prompts):
        return HELD_HERE
    rate = _rate(prefill)
    if rate is None:
        return DISAGGREGATED
    wait_there = prefill.outstanding_tokens / rate  # a prefill worker's: prompt tokens to compute
    here = (decode.local_prefill_tokens + num_tokens) / rate
    if wait_there <= here:
        return DISAGGREGATED
    w = weighed(prefill, decode)
    waiting, streams = w["prefill_prompts"], w["decode_streams"]
    if streams and num_tokens > cfg.decode_prefill_max_tokens:
        return DISAGGREGATED
    if (
        streams
        and waiting < DEEP * streams
        and (now() if t is None else t) < decode.prefill_busy_until
    ):
        return DISAGGREGATED  # the last such prompt's share of its time is not over
    if (
        waiting >= STARVED * streams
        and here * max(streams, 1) <= cfg.decode_prefill_budget_s * waiting
    ):
        return PREFILL_BUSY
    return DISAGGREGATED
