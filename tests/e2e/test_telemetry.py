"""Traces, logs and metrics of a real cluster (gateway, prefill, decode processes, KV over UCX),
exported to a real OTLP/gRPC receiver started by the test."""

from __future__ import annotations

import json

import grpc
import pytest
import torch
from pdserve.services.launcher import stop_processes

from pdserve import Client, SamplingParams
from pdserve.config import resolve_dtype, resolve_kv_cache_dtype
from pdserve.model.config import ModelConfig
from pdserve.model.quantize import resolve_quantization
from pdserve.otlp_sink import SpanSink
from pdserve.transfer import KVLayout
from pdserve.transfer.header import HEADER_NBYTES
from pdserve.transfer.plan import plan_nbytes
from tests.e2e.cluster import start_cluster
from tests.helpers import assert_no_leaks, scrape_metrics

SECRET = "zebra quokka marmalade"  # a prompt that must never appear in the logs
SPAN_NAMES = {
    "gateway.generate",
    "router.pick",
    "decode.admit",
    "prefill.prefill",
    "kv.send",
    "decode.kv_receive",
    "decode.generate",
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, default_model_dir):
    """A cluster exporting to a SpanSink; each process's stderr (its logs) goes to a file."""
    logs = tmp_path_factory.mktemp("logs")
    files = {name: (logs / f"{name}.log").open("w") for name in ("gateway", "prefill", "decode")}
    with SpanSink() as sink:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        c = start_cluster(env=env, stderr=files["gateway"])
        try:
            c.start_worker("prefill", "prefill", stderr=files["prefill"])
            c.start_worker("decode", "decode", stderr=files["decode"])
            yield c, sink, logs
        finally:
            stop_processes(c.procs)
            for f in files.values():
                f.close()


def _trace_of(sink: SpanSink, request_id: str, names=SPAN_NAMES) -> dict[str, dict]:
    """The spans of the trace whose gateway span has ``request_id``, once ``names`` all arrived."""

    def spans_of_trace(spans):
        root = [
            s
            for s in spans
            if s["name"] == "gateway.generate" and s["attributes"].get("request_id") == request_id
        ]
        return [s for s in spans if root and s["trace_id"] == root[0]["trace_id"]]

    sink.wait_for(lambda spans: names <= {s["name"] for s in spans_of_trace(spans)}, timeout=15)
    trace = spans_of_trace(sink.spans())
    by_name = {}
    for s in trace:
        assert s["name"] not in by_name or s["name"] == "router.pick", (
            f"two {s['name']} spans: {trace}"
        )
        by_name[s["name"]] = s
    return by_name


def _kv_dtype(model_dir) -> torch.dtype:
    """The workers' KV cache dtype: --kv-cache-dtype auto, resolved as their runner does."""
    dtype = resolve_dtype("auto", "cpu")
    quantization = resolve_quantization("auto", model_dir, dtype, "cpu")
    return resolve_kv_cache_dtype("auto", dtype, "cpu", quantization)


def _kv_bytes(model_dir, num_prompt_tokens: int, block_size: int = 16) -> int:
    cfg = ModelConfig.from_file(model_dir / "config.json")
    layout = KVLayout(
        model=model_dir.name,
        dtype=_kv_dtype(model_dir),
        block_size=block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    # Sent direct (transfer/plan.py): the decode worker's fresh blocks are one run, so a plan
    # with one segment, each layer's K and V, and the trailer with the first token.
    num_blocks = -(-num_prompt_tokens // block_size)
    return plan_nbytes(1) + cfg.num_layers * 2 * num_blocks * layout.block_nbytes() + HEADER_NBYTES


def test_one_request_is_one_trace_across_the_three_services(traced, default_model_dir):
    c, sink, _ = traced
    prompt = list(range(100, 140))  # 40 tokens: 3 blocks
    with Client(c.gateway, timeout=60) as client:
        deltas = list(
            client.generate_stream(
                prompt,
                SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                request_id="trace-one",
            )
        )
    assert sum(len(d.token_ids) for d in deltas) == 6
    t = _trace_of(sink, "trace-one")
    gw = t["gateway.generate"]
    assert len({s["trace_id"] for s in t.values()}) == 1
    assert {t[n]["service"] for n in t} == {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}
    assert gw["parent_span_id"] == "" and gw["service"] == "pdserve-gateway"
    # Parent links: over gRPC metadata to both workers, over the KV header from prefill to decode.
    for child in ("router.pick", "decode.admit", "prefill.prefill", "decode.generate"):
        assert t[child]["parent_span_id"] == gw["span_id"], child
    assert t["kv.send"]["parent_span_id"] == t["prefill.prefill"]["span_id"]
    assert t["decode.kv_receive"]["parent_span_id"] == t["prefill.prefill"]["span_id"]
    assert (t["decode.admit"]["service"], t["decode.kv_receive"]["service"]) == (
        "pdserve-decode",
    ) * 2
    # Attributes.
    a = gw["attributes"]
    assert (a["prompt_tokens"], a["completion_tokens"], a["finish_reason"], a["outcome"]) == (
        40,
        6,
        "length",
        "ok",
    )
    assert a["ttft_s"] > 0 and a["tpot_s"] > 0 and gw["status"] != "ERROR"
    pick = t["router.pick"]["attributes"]
    assert pick["policy"] == "cost" and pick["mode"] == "disaggregated"
    # what placement weighed: nothing else of the gateway's at either worker
    assert (pick["prefill_prompts"], pick["decode_streams"]) == (0, 0)
    assert pick["decode"] == c.workers["decode"][1] and pick["prefill"] == c.workers["prefill"][1]
    assert t["decode.admit"]["attributes"]["blocks_reserved"] == 3
    p = t["prefill.prefill"]["attributes"]
    assert p["batch_size"] >= 1 and p["queue_wait_s"] >= 0 and p["forward_s"] > 0
    expected_bytes = _kv_bytes(default_model_dir, 40)
    cfg = ModelConfig.from_file(default_model_dir / "config.json")
    for name in ("kv.send", "decode.kv_receive"):
        kv = t[name]["attributes"]
        assert kv["bytes"] == expected_bytes, name
        assert kv["layers"] == cfg.num_layers and kv["gbps"] > 0 and kv["seconds"] > 0, name
    assert 0 <= t["kv.send"]["attributes"]["overlap_fraction"] <= 1
    assert t["kv.send"]["attributes"]["direct"] is True
    d = t["decode.generate"]["attributes"]
    assert (d["completion_tokens"], d["finish_reason"]) == (
        5,
        "length",
    )  # the first came from prefill
    # No span per token.
    assert len(sink.spans(gw["trace_id"])) == len(SPAN_NAMES)


def test_a_client_traceparent_is_honoured(traced):
    c, sink, _ = traced
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with Client(c.gateway, timeout=60) as client:
        client.complete(
            [5, 6, 7],
            SamplingParams(max_tokens=2, temperature=0),
            request_id="trace-client",
            metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),),
        )
    t = _trace_of(sink, "trace-client")
    assert t["gateway.generate"]["trace_id"] == trace_id
    assert t["gateway.generate"]["parent_span_id"] == parent_id
    assert {s["trace_id"] for s in t.values()} == {trace_id}


def test_a_failed_request_carries_the_error_status(traced):
    c, sink, _ = traced
    with Client(c.gateway, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.complete("hello", SamplingParams(max_tokens=1_000_000), request_id="trace-bad")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    t = _trace_of(sink, "trace-bad", names={"gateway.generate"})
    gw = t["gateway.generate"]
    assert gw["status"] == "ERROR"
    assert (
        "INVALID_ARGUMENT" in gw["status_message"]
        and "exceeds this model's context" in gw["status_message"]
    )
    assert gw["attributes"]["outcome"] == "invalid_argument"


def test_logs_are_json_with_the_exported_trace_ids_and_no_prompt(traced):
    c, sink, logs = traced
    with Client(c.gateway, timeout=60) as client:
        client.complete(
            SECRET, SamplingParams(max_tokens=3, temperature=0), request_id="trace-logs"
        )
    t = _trace_of(sink, "trace-logs")
    span_ids = {s["span_id"] for s in t.values()}
    trace_id = t["gateway.generate"]["trace_id"]
    seen = {}
    for name in ("gateway", "prefill", "decode"):
        text = (logs / f"{name}.log").read_text()
        assert SECRET not in text and "quokka" not in text, f"prompt text in the {name} log"
        for line in filter(None, text.splitlines()):
            record = json.loads(line)  # every line is one JSON object
            assert (
                record["service"] == f"pdserve-{name}"
                and "event" in record
                and "timestamp" in record
            )
            if record.get("request_id", "").startswith("trace-logs"):
                assert record["trace_id"] == trace_id, record
                assert record["span_id"] in span_ids, record
                seen.setdefault(name, []).append(record["event"])
    assert set(seen) == {"gateway", "prefill", "decode"}, seen
    assert {"request.start", "request.routed", "request.end"} <= set(seen["gateway"])


def _delta(before, after, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_agree_with_what_was_sent(traced, default_model_dir):
    c, _, _ = traced
    names = ("gateway", "prefill", "decode")
    before = {n: scrape_metrics(c.metrics[n]) for n in names}
    jobs = [
        (list(range(10, 10 + n_prompt)), n_out)
        for n_prompt, n_out in [(5, 1), (17, 4), (33, 7), (64, 2)]
    ]
    with Client(c.gateway, timeout=60) as client:
        for ids, n in jobs:
            list(
                client.generate_stream(
                    ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                )
            )
        with pytest.raises(grpc.RpcError):
            client.complete([], SamplingParams(max_tokens=1))
    assert_no_leaks(c.live())
    after = {n: scrape_metrics(c.metrics[n]) for n in names}
    g, p, d = ((before[n], after[n]) for n in names)
    num, outs, prompts = len(jobs), sum(n for _, n in jobs), sum(len(ids) for ids, _ in jobs)
    # gateway: one ok per request, tokens as sent, one TTFT per request, one ITL per later token
    assert _delta(*g, "pdserve_requests_total", outcome="ok") == num
    assert _delta(*g, "pdserve_requests_total", outcome="invalid_argument") == 1
    assert _delta(*g, "pdserve_completion_tokens_total") == outs
    assert _delta(*g, "pdserve_prompt_tokens_total") == prompts
    assert _delta(*g, "pdserve_ttft_seconds_count") == num
    assert _delta(*g, "pdserve_itl_seconds_count") == outs - num
    assert _delta(*g, "pdserve_tpot_seconds_count") == sum(n > 1 for _, n in jobs)
    assert _delta(*g, "pdserve_queue_seconds_count") == num
    assert _delta(*g, "pdserve_requests_without_disaggregation_total") == 0
    assert after["gateway"][("pdserve_requests_running", ())] == 0
    # prefill: one first token and one KV push per request, of the expected size
    assert _delta(*p, "pdserve_requests_total", outcome="ok") == num
    assert _delta(*p, "pdserve_generated_tokens_total") == num
    assert _delta(*p, "pdserve_kv_transfer_bytes_count", direction="send") == num
    expected = sum(_kv_bytes(default_model_dir, len(ids)) for ids, _ in jobs)
    # whole blocks the decode worker already held (decode-side prefix reuse) are not sent
    reused = int(_delta(*d, "pdserve_kv_prefix_reused_tokens_total"))
    expected -= _kv_bytes(default_model_dir, reused) - _kv_bytes(default_model_dir, 0)
    assert _delta(*p, "pdserve_kv_transfer_bytes_sum", direction="send") == expected
    assert _delta(*p, "pdserve_step_seconds_count", phase="prefill") >= 1
    # decode: the rest of the tokens, the same KV received, every block free again
    assert _delta(*d, "pdserve_requests_total", outcome="ok") == num
    assert _delta(*d, "pdserve_generated_tokens_total") == outs - num
    assert _delta(*d, "pdserve_kv_transfer_bytes_sum", direction="recv") == expected
    assert _delta(*d, "pdserve_kv_transfer_failures_total", direction="recv") == 0
    # the roofline (on by default): measured at start, a fraction observed for every step
    for n, pair in (("prefill", p), ("decode", d)):
        assert after[n][("pdserve_roofline_memory_bandwidth_bytes_per_second", ())] > 1e9, n
        assert after[n][("pdserve_roofline_gemm_flops_per_second", ())] > 1e9, n
        steps = _delta(*pair, "pdserve_step_seconds_count", phase=n)
        assert _delta(*pair, "pdserve_step_roofline_fraction_count", phase=n) == steps >= 1, n
    for n in ("prefill", "decode"):
        assert after[n][("pdserve_kv_blocks", (("state", "used"),))] == 0, n
        assert after[n][("pdserve_kv_blocks", (("state", "free"),))] > 0, n
        assert after[n][("pdserve_requests_running", ())] == 0, n
