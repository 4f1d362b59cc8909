"""Decode-side prefix reuse between real processes, KV over UCX, with the default model: a second
request sharing a long prefix is sent only the blocks after the ones its decode worker holds, and
its greedy tokens are the offline engine's."""

from __future__ import annotations

import pytest

from pdserve import LLM, Client, SamplingParams
from pdserve.config import CacheConfig
from tests.e2e.cluster import running_cluster
from tests.helpers import assert_no_leaks, metric_value

BLOCK = 16
DOCUMENT = (
    "The river starts high in the mountains, where snow melts each spring and feeds a hundred "
    "small streams. They join in the valley, turn the old mill, pass the town with the stone "
    "bridge, and widen into a slow brown current that boats use to carry grain, timber and "
    "wool down to the sea. In summer children swim near the bridge; in winter the banks freeze "
    "and the ferry stops. The town keeps a record of every flood since the year the mill was "
    "built, painted as lines on the wall of the church, the highest one taller than a man."
)
QUESTIONS = ["What does the river carry?", "When does the ferry stop?"]


@pytest.fixture(scope="module")
def pair():
    with running_cluster({"prefill": "prefill", "decode": "decode"}) as c:
        yield c


def test_a_shared_prefix_is_sent_once_over_ucx_and_tokens_equal_the_offline_engine(pair):
    llm = LLM(threads=2, cache=CacheConfig(kv_cache_bytes=256 << 20))
    prompts = [llm.tokenizer.encode(llm.chat_prompt(q, system=DOCUMENT)) for q in QUESTIONS]
    shared = 0
    while prompts[0][shared] == prompts[1][shared]:
        shared += 1
    assert shared >= 7 * BLOCK  # the document: many whole blocks in common
    params = SamplingParams(max_tokens=16, temperature=0)
    expected = [llm.generate([p], params)[0].token_ids for p in prompts]  # one after the other

    def recv() -> tuple[float, float]:
        m = pair.metrics["decode"]
        return (
            metric_value(m, "pdserve_kv_transfer_bytes_sum", direction="recv"),
            metric_value(m, "pdserve_kv_prefix_reused_tokens_total"),
        )

    got, nbytes, reused, cached = [], [], [], []
    with Client(pair.gateway, timeout=120) as client:
        for prompt in prompts:
            before = recv()
            r = client.complete(prompt, params)
            after = recv()
            got.append(list(r.token_ids))
            cached.append(r.usage.cached_prompt_tokens)
            nbytes.append(after[0] - before[0])
            reused.append(after[1] - before[1])
    assert got == expected
    reuse = min(shared // BLOCK, (len(prompts[1]) - 1) // BLOCK) * BLOCK
    assert reused == [0, reuse]
    assert cached == [0, reuse]  # the one prefill worker's cache holds the same blocks
    # bytes per block sent are the same for both transfers: the second sent only its suffix
    sent = [-(-len(p) // BLOCK) for p in prompts]
    sent[1] -= reuse // BLOCK
    per_block = [b / n for b, n in zip(nbytes, sent, strict=True)]
    assert per_block[1] == pytest.approx(per_block[0], rel=0.02)
    print(f"KV bytes: {nbytes[0]:.0f} for {sent[0]} blocks, then {nbytes[1]:.0f} for {sent[1]}")
    assert_no_leaks(pair.live())
