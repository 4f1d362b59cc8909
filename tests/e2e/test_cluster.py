"""Gateway -> prefill -> KV over UCX -> decode, as real processes with the default model, driven
through the public API. Routing, cancel, stop strings and bad input are the in-process tier's
(tests/serve); here: the real model's tokens across processes, and UCX under many streams."""

from __future__ import annotations

import concurrent.futures
import random

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from tests.helpers import assert_no_leaks

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2 + 2?",
    "Say hello in French.",
    "What is a cat?",
    "Describe the sun in one sentence.",
    "What is Python?",
    "Why do birds sing?",
    "Give me a word that rhymes with tree.",
    "What is the tallest mountain?",
    "What is water made of?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name a planet.",
    "What language is spoken in Spain?",
    "What do bees make?",
]


def test_greedy_outputs_equal_the_offline_engine(cluster):
    llm = LLM(threads=2, cache=CacheConfig(kv_cache_bytes=256 << 20))
    prompts = [llm.tokenizer.encode(llm.chat_prompt(q)) for q in QUESTIONS]
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    with (
        Client(cluster.gateway, timeout=120) as c,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        got = list(pool.map(lambda p: list(c.complete(p, params).token_ids), prompts))
    assert got == expected
    assert_no_leaks(cluster.live())


def test_64_concurrent_streams_complete_and_free_every_block(cluster):
    rng = random.Random(0)
    words = "river stone light music engine garden paper cloud winter signal".split()
    jobs = [
        (" ".join(rng.choice(words) for _ in range(rng.randint(4, 300))), rng.randint(1, 32))
        for _ in range(64)
    ]

    def run(job):
        text, n = job
        with Client(cluster.gateway, timeout=300) as c:
            deltas = list(
                c.generate_stream(
                    text, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                )
            )
        return sum(len(d.token_ids) for d in deltas), deltas[-1].finish_reason

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, jobs))
    assert results == [(n, "length") for _, n in jobs]
    assert_no_leaks(cluster.live())


def test_the_gateway_serves_without_torch(cluster):
    """The gateway holds no model: it never imports torch (~200 MB and ~1.7 s of its start),
    not at start and not while it serves a request; a worker does (the check sees libtorch)."""
    with Client(cluster.gateway, timeout=120) as c:
        out = c.complete("Name a planet.", SamplingParams(max_tokens=4, temperature=0))
    assert len(out.token_ids) == 4
    gateway, worker = cluster.procs[0], cluster.procs[1]
    assert not _maps_libtorch(gateway.pid)
    assert _maps_libtorch(worker.pid)


def _maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()
