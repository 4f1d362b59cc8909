"""``pdserve bench serve``'s load generator (pdserve/bench_serve.py) against a real gateway over
both APIs: what it reports is what the server served."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench_serve import print_summary, run_load
from tests.serve.conftest import start_cluster


@pytest.fixture(scope="module")
def http_cluster(tiny_model_dir):
    c = start_cluster(tiny_model_dir, prefill=1, decode=1, http=True)
    yield c
    c.close()


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_prompt_tokens_and_outputs_are_the_servers_count(http_cluster, api):
    c = http_cluster
    prompt_before = c.gateway_metric("pdserve_prompt_tokens_total")
    completion_before = c.gateway_metric("pdserve_completion_tokens_total")
    http = c.http_address if api == "http" else None
    s = asyncio.run(run_load(c.address, 3, 2, None, "20-60", 5, 7, 60, http=http))
    assert s["errors"] == 0, s["error_samples"]
    served_prompt = c.gateway_metric("pdserve_prompt_tokens_total") - prompt_before
    assert served_prompt > 3 * 20  # about a token a word, and a few more
    assert s["prompt_tokens_mean"] == pytest.approx(served_prompt / 3)
    served_out = c.gateway_metric("pdserve_completion_tokens_total") - completion_before
    assert served_out == 3 * 5
    assert s["output_tokens_per_s"] * s["wall_s"] == pytest.approx(served_out)


def test_the_summary_says_the_prompts_mean_length(capsys):
    s = {
        "requests": 2,
        "errors": 0,
        "error_samples": [],
        "wall_s": 1.0,
        "output_tokens_per_s": 10.0,
        "requests_per_s": 2.0,
        "prompt_tokens_mean": 41.5,
        "ttft_s": {},
        "tpot_s": {},
        "itl_s": {},
        "ttft_long_prompts_s": {},
    }
    print_summary(s)
    assert "prompts of 42 tokens on average" in capsys.readouterr().out
