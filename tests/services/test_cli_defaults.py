"""The command line's defaults are the config dataclasses' own: parsing no options builds the
same configs as the dataclasses' defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from pdserve.services import cli as serve_cli
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.registry import ROLES

from pdserve.cli import build_parser
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.telemetry import TelemetryConfig


def test_gateway_defaults_are_gateway_configs():
    args = build_parser().parse_args(["gateway"])
    assert serve_cli.gateway_config(args) == GatewayConfig()
    assert serve_cli.telemetry_config(args, "gateway") == TelemetryConfig("gateway")


def test_gateway_options_reach_the_config():
    args = build_parser().parse_args(
        "gateway --policy round_robin --lease 3 --kv-timeout 7 --max-attempts 5 --max-resumes 2 "
        "--queue-timeout 9 --outage-wait 4 --api-keys k.json --probe-interval 0.5 --real-probe-interval 4 "
        "--suspect-after 2 --probe-timeout 0.25 --real-probe-timeout 1.5 "
        "--engine-timeout 12 --local-prefill-tokens 8 --decode-prefill-budget 0.25 "
        "--decode-prefill-max-tokens 512 --decode-prefill-share 0.5 "
        "--stuck-step-floor 1.5 --stuck-step-factor 3 --affinity-slack 2".split()
    )
    assert serve_cli.gateway_config(args) == GatewayConfig(
        policy="round_robin",
        lease_s=3.0,
        kv_timeout_s=7.0,
        max_attempts=5,
        max_resumes=2,
        queue_timeout_s=9.0,
        outage_wait_s=4.0,
        api_keys_file="k.json",
        local_prefill_tokens=8,
        decode_prefill_budget_s=0.25,
        decode_prefill_max_tokens=512,
        decode_prefill_share=0.5,
        probe_interval_s=0.5,
        real_probe_interval_s=4.0,
        suspect_after_s=2.0,
        probe_timeout_s=0.25,
        real_probe_timeout_s=1.5,
        engine_timeout_s=12.0,
        stuck_step_floor_s=1.5,
        stuck_step_factor=3.0,
        affinity_slack_s=2.0,
    )


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_the_routing_policy_is_cost_unless_chosen_and_a_bad_one_says_what_is_allowed(
    command, capsys
):
    assert build_parser().parse_args([command]).policy == GatewayConfig().policy == "cost"
    assert build_parser().parse_args([command, "--policy", "round_robin"]).policy == "round_robin"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--policy", "fastest"])
    assert exit_.value.code == 2
    # Python 3.12 stopped quoting the choices
    err = (
        capsys.readouterr().err.replace("'cost'", "cost").replace("'least_loaded'", "least_loaded")
    )
    err = err.replace("'round_robin'", "round_robin")
    assert "invalid choice: 'fastest' (choose from cost, least_loaded, round_robin)" in err


def test_a_bad_hang_detection_option_is_a_clear_error():
    args = build_parser().parse_args(["gateway", "--probe-timeout", "0"])
    with pytest.raises(ValueError, match="probe_timeout_s must be > 0 seconds, got 0.0"):
        serve_cli.gateway_config(args)


@pytest.mark.parametrize("command", [*ROLES, "up"])
def test_engine_defaults_are_engine_configs(command):
    args = build_parser().parse_args([command])
    model = args.model
    assert serve_cli.engine_config(args) == EngineConfig(model)
    assert serve_cli.engine_config(args).cache == CacheConfig()
    assert serve_cli.engine_config(args).scheduler == SchedulerConfig()


def test_generate_sampling_defaults_are_sampling_params_but_for_its_own_two():
    from pdserve.cli import _sampling

    args = build_parser().parse_args(["generate", "hi"])
    # generate chooses greedy and a longer answer; everything else is SamplingParams'
    expected = dataclasses.replace(SamplingParams(), max_tokens=128, temperature=0.0)
    assert _sampling(args) == expected


def test_every_gateway_config_field_has_an_option():
    args = vars(build_parser().parse_args(["gateway"]))
    options = {
        "policy",
        "lease",
        "kv_timeout",
        "max_attempts",
        "max_resumes",
        "queue_timeout",
        "outage_wait",
        "api_keys",
        "local_prefill_tokens",
        "decode_prefill_budget",
        "decode_prefill_max_tokens",
        "decode_prefill_share",
        "probe_interval",
        "real_probe_interval",
        "suspect_after",
        "probe_timeout",
        "real_probe_timeout",
        "engine_timeout",
        "stuck_step_floor",
        "stuck_step_factor",
        "affinity_slack",
        "warm_replies",
    }
    assert options <= set(args)
    assert len(options) == len(dataclasses.fields(GatewayConfig))


@pytest.mark.parametrize("command", [*ROLES, "up"])
def test_no_prefix_caching_reaches_the_cache_config(command):
    args = build_parser().parse_args([command, "--no-prefix-caching"])
    assert serve_cli.engine_config(args).cache == CacheConfig(enable_prefix_caching=False)


def test_pdserve_up_lends_its_prefill_and_decode_workers_each_others_core_and_nothing_else():
    """`pdserve up` on its own: one prefill and one decode worker pinned to cores of their own,
    each borrowing the other's; any other shape lends nothing."""
    from pdserve.services.launcher import _borrowed

    assert _borrowed(["prefill", "decode"], ["0", "1"]) == {1: "0", 0: "1"}
    assert _borrowed(["prefill", "decode"], ["", ""]) == {}  # --no-pin
    assert _borrowed(["prefill", "decode"], ["0", "0"]) == {}  # one core for both
    assert _borrowed(["prefill", "prefill", "decode"], ["0", "1", "2"]) == {}
    assert _borrowed(["prefill", "decode", "decode"], ["0", "1", "2"]) == {}
    assert _borrowed(["colocated"], ["0"]) == {}
    assert build_parser().parse_args(["up"]).borrow
    assert not build_parser().parse_args(["up", "--no-borrow"]).borrow


def test_borrowed_cores_are_a_prefill_and_decode_option_and_bad_ones_say_what_is_allowed(capsys):
    args = build_parser().parse_args(["decode", "--borrow-cpus", "0,2"])
    assert args.borrow_cpus == frozenset({0, 2})
    assert build_parser().parse_args(["prefill", "--borrow-cpus", "1"]).borrow_cpus == {1}
    assert build_parser().parse_args(["decode"]).borrow_cpus == frozenset()
    for bad in ("zero", "-1"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["decode", "--borrow-cpus", bad])
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cores are written as numbers separated by commas, e.g. 0 or 0,1; got 'zero'" in err
    assert "core numbers are >= 0, got '-1'" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["colocated", "--borrow-cpus", "0"])


def test_a_worker_pinned_or_borrowing_outside_its_cores_says_so_and_exits():

    from pdserve.services.cpus import usable_cpus

    outside = max(usable_cpus()) + 1
    allowed = ",".join(map(str, sorted(usable_cpus())))
    for option in ("--cpus", "--borrow-cpus"):
        assert worker_exit_message("decode", option, str(outside)).endswith(
            f"{option}: core(s) {outside} are not among those this process may run on ({allowed})"
        )


def worker_exit_message(*argv: str) -> str:
    """What ``pdserve <argv>`` says as it exits with status 1 (before it loads a model)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr
    return r.stderr.strip()


def test_pdserve_up_pins_each_worker_to_a_core_per_thread():
    """`pdserve up --threads-per-worker 2` on two cores pinned its colocated worker's two threads
    to one core (a W-c32 step 2.5 s instead of ~70 ms)."""
    from pdserve.services.launcher import _cpu_sets

    assert _cpu_sets(1, 2, [0, 1]) == ["0,1"]
    assert _cpu_sets(2, 1, [0, 1]) == ["0", "1"]  # the default cluster: a core each
    assert _cpu_sets(3, 1, [0, 1]) == ["0", "1", "0"]
    assert _cpu_sets(2, 2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert _cpu_sets(2, 2, [0, 1]) == ["0,1", "0,1"]  # fewer cores than threads: they share
    assert _cpu_sets(1, 4, [4, 6]) == ["4,6"]


def test_pdserve_up_gives_its_workers_its_device_one_gpu_each_where_there_are_several():
    """`pdserve up --device cuda` started its workers without `--device`: on the CPU."""
    from pdserve.services.launcher import _spread_devices

    assert _spread_devices("cpu", 2, 0) == ["cpu", "cpu"]
    assert _spread_devices("cuda", 2, 1) == ["cuda", "cuda"]  # one GPU: both on it
    assert _spread_devices("cuda", 3, 2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert _spread_devices("cuda:1", 2, 4) == ["cuda:1", "cuda:1"]  # a GPU named: all on it


def test_pdserve_up_warns_when_its_workers_threads_outnumber_the_cores():
    from pdserve.services.launcher import _oversubscribed

    assert _oversubscribed(2, 1, 2) is None  # the default cluster on 2 cores
    assert _oversubscribed(1, 2, 2) is None  # one colocated worker, a core per thread
    assert _oversubscribed(1, 4, 2) is not None  # (pinned, the worker itself also refuses it)
    assert _oversubscribed(2, 2, 2) == (
        "pdserve up: 2 workers x 2 threads on 2 core(s): the workers' threads share cores and "
        "wait for each other (measured on 2 cores: W-c8 191 tok/s with --threads-per-worker 2, "
        "338 with 1, where each worker also borrows the other's idle core)"
    )
    assert _oversubscribed(3, 1, 2) is not None


def test_a_worker_with_more_threads_than_its_pinned_cores_says_so_and_exits():
    from pdserve.services.cpus import usable_cpus

    core = min(usable_cpus())
    assert worker_exit_message("colocated", "--cpus", str(core), "--threads", "2").endswith(
        f"--threads 2 is more than the 1 core(s) of --cpus {core}: threads that share a core wait "
        "for each other at every step's barriers (a step ~35x slower, measured); give --cpus a "
        "core per thread, or fewer threads"
    )


def test_a_worker_started_by_a_launcher_pinned_elsewhere_may_pin_itself_to_another_core():
    """A launcher pinned to core 0 (bench/gateway_overhead.py beside its gateway) starts a worker
    with --cpus 1: the worker inherits {0} and still pins itself to 1."""
    import subprocess
    import sys

    from pdserve.services.cpus import usable_cpus

    if len(usable_cpus()) < 2:
        pytest.skip("needs two cores")
    first, second = sorted(usable_cpus())[:2]
    code = (
        "import os; from pdserve.services.cpus import pin; "
        f"os.sched_setaffinity(0, {{{first}}}); pin(frozenset({{{second}}}), frozenset({{{first}}})); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"[{second}]"


@pytest.mark.parametrize("command", [*ROLES, "up"])
def test_a_lazy_kv_cache_is_a_choice_and_a_resident_one_the_default(command):
    assert serve_cli.engine_config(build_parser().parse_args([command])).cache.resident
    args = build_parser().parse_args([command, "--lazy-kv-cache"])
    assert serve_cli.engine_config(args).cache == CacheConfig(resident=False)


@pytest.mark.parametrize("role", ROLES)
def test_pdserve_up_gives_its_workers_every_engine_option_it_was_given(role):
    """`pdserve up --max-num-seqs 8` (and --max-num-batched-tokens) reached no worker."""
    from pdserve.services.launcher import engine_argv

    options = ["--model", "/models/x", "--dtype", "float32", "--quantization", "int8"]
    options += ["--kv-cache-bytes", "256M", "--block-size", "32", "--no-prefix-caching"]
    options += ["--lazy-kv-cache", "--max-num-seqs", "8", "--max-num-batched-tokens", "96"]
    options += ["--kv-cache-dtype", "bfloat16", "--prompt-order", "arrival"]
    up = build_parser().parse_args(["up", *options])
    worker = build_parser().parse_args([role, *engine_argv(up)])
    assert serve_cli.engine_config(worker) == serve_cli.engine_config(up)
    assert serve_cli.engine_config(up) != serve_cli.engine_config(build_parser().parse_args(["up"]))
    defaults = build_parser().parse_args([role, *engine_argv(build_parser().parse_args(["up"]))])
    assert serve_cli.engine_config(defaults) == EngineConfig(defaults.model)


def test_pdserve_up_threads_are_each_workers_whichever_option_says_so():
    """`pdserve up --threads 2` was accepted and ignored: every worker ran one thread."""
    from pdserve.services.launcher import threads_per_worker

    def threads(*argv):
        return threads_per_worker(build_parser().parse_args(["up", *argv]))

    assert threads() == 1
    assert threads("--threads", "2") == threads("--threads-per-worker", "2") == 2
    assert threads("--threads", "2", "--threads-per-worker", "2") == 2
    with pytest.raises(ValueError, match="--threads 2 and --threads-per-worker 1 disagree"):
        threads("--threads", "2", "--threads-per-worker", "1")
    with pytest.raises(ValueError, match="at least one thread, got 0"):
        threads("--threads-per-worker", "0")


def test_the_stream_interval_reaches_the_workers_that_stream():
    """`pdserve up --stream-interval 10`: the decode and colocated workers hand a request's tokens
    on at most every 10 ms; a prefill worker returns only the first token and gets nothing. auto
    (None) is every streaming worker's default, and `pdserve up`'s passes nothing on."""
    from pdserve.services.launcher import stream_argv

    up = build_parser().parse_args(["up", "--stream-interval", "10"])
    for role in ("decode", "colocated"):
        worker = build_parser().parse_args([role, *stream_argv(up, role)])
        assert serve_cli.worker_options(worker).stream_interval_s == 0.01
        for argv in ([role], [role, "--stream-interval", "auto"]):
            assert (
                serve_cli.worker_options(build_parser().parse_args(argv)).stream_interval_s is None
            )
        worker = build_parser().parse_args([role, "--stream-interval", "0"])
        assert serve_cli.worker_options(worker).stream_interval_s == 0
    assert stream_argv(up, "prefill") == []
    for argv in (["up"], ["up", "--stream-interval", "auto"]):
        assert stream_argv(build_parser().parse_args(argv), "decode") == []
    assert stream_argv(build_parser().parse_args(["up", "--stream-interval", "0"]), "decode") == [
        "--stream-interval",
        "0",
    ]
    with pytest.raises(SystemExit):  # a prefill worker has no such option
        build_parser().parse_args(["prefill", "--stream-interval", "10"])


@pytest.mark.parametrize("value", ["-5", "fast", "nan"])
def test_a_stream_interval_that_is_not_auto_or_milliseconds_is_refused(value, capsys):
    for argv in (["up"], ["decode"], ["colocated"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, "--stream-interval", value])
        err = capsys.readouterr().err
        assert (
            f"--stream-interval is auto or milliseconds >= 0 (0: every token at once), got {value!r}"
            in err
        )


def test_the_transport_choices_are_the_transfer_packages_and_building_the_cli_needs_no_torch():
    """The CLI names the KV transports without importing the transfer package (its options are
    built for every command, the gateway's and `pdserve health`'s too, which never import torch:
    a health probe is ~55 MB and 0.4 s, not ~260 MB and ~2 s)."""
    from pdserve.services.cli_options import KV_TRANSPORTS

    from pdserve.transfer import TRANSPORTS

    assert KV_TRANSPORTS == TRANSPORTS
    code = (
        "import sys; from pdserve.cli import build_parser; build_parser(); "
        "import pdserve.services.gateway.server, pdserve.services.health_cli; "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
