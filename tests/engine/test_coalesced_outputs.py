"""EngineLoop's stream interval: a request's outputs handed on at most every ``stream_interval_s``,
the ones between merged (the first and the last at once), the same tokens either way."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from pdserve.engine_loop import AUTO_STREAM_INTERVAL_S, EngineLoop, auto_stream_interval
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from tests.engine.test_disaggregated_engine import engine, run_all

PROMPT = [1, 5, 9, 200, 33, 7, 8, 9, 10]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def streamed(folder, interval_s: float | None, loops: list | None = None) -> list[RequestOutput]:
    """The outputs of one request through an EngineLoop with ``interval_s``, as its stream got them
    (the loop appended to ``loops``)."""

    async def scenario() -> list[RequestOutput]:
        loop = EngineLoop(engine(folder), warm_up=False, stream_interval_s=interval_s)
        if loops is not None:
            loops.append(loop)
        loop.start(asyncio.get_running_loop())
        try:
            stream = loop.open_stream("r")
            await loop.call(lambda e: e.add_request(PROMPT, PARAMS, "r"))
            outputs = [await stream.get()]
            while not outputs[-1].finished:
                outputs.append(await stream.get())
            return outputs
        finally:
            loop.stop()

    return asyncio.run(scenario())


def test_outputs_within_the_interval_go_on_together_with_the_same_tokens(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    e.add_request(PROMPT, PARAMS, "r")
    expected = run_all(e)["r"]
    # an interval no step reaches: the first token at once, the other eleven with the last
    outputs = streamed(folder, 3600.0)
    assert [len(o.new_token_ids) for o in outputs] == [1, 11]
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert [o.finish_reason for o in outputs] == [None, "length"]
    assert [o.num_prompt_tokens for o in outputs] == [len(PROMPT)] * 2
    # none: every step's output is its own message
    outputs = streamed(folder, 0.0)
    assert [len(o.new_token_ids) for o in outputs] == [1] * 12
    assert [t for o in outputs for t in o.new_token_ids] == expected


def out(rid: str, *tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        rid,
        new_token_ids=list(tokens),
        new_logprobs=[None] * len(tokens),
        finished=finished,
        finish_reason="length" if finished else None,
    )


def test_a_held_output_goes_on_when_its_interval_has_passed_new_output_or_not(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    for rid in ("a", "b"):
        e.add_request(PROMPT, PARAMS, rid)
    loop = EngineLoop(e, warm_up=False, stream_interval_s=0.010)  # not started: _coalesce alone

    def tokens(ready: list[RequestOutput]) -> list[tuple[str, list[int]]]:
        return [(o.request_id, o.new_token_ids) for o in ready]

    assert tokens(loop._coalesce([out("a", 1), out("b", 1)], now=0.0)) == [("a", [1]), ("b", [1])]
    assert loop._coalesce([out("a", 2), out("b", 2)], now=0.004) == []
    assert loop._coalesce([out("a", 3)], now=0.008) == []  # b waits for a step this time
    # a's interval has passed with a new output, b's with none: both go, merged in order
    assert tokens(loop._coalesce([out("a", 4)], now=0.011)) == [("a", [2, 3, 4]), ("b", [2])]
    merged = loop._coalesce([out("a", 5, finished=True)], now=0.012)
    assert tokens(merged) == [("a", [5])] and merged[0].finished  # the last goes at once
    assert len(merged[0].new_logprobs) == 1
    assert "a" not in loop._handed_at
    # b aborted while an output of it is held: forgotten, not handed on
    assert loop._coalesce([out("b", 3)], now=0.013) == []
    e.abort_request("b")
    assert loop._coalesce([], now=0.030) == []
    assert loop._held == {} and loop._handed_at == {}


def test_a_negative_interval_is_refused(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    with pytest.raises(ValueError, match="stream interval must be >= 0"):
        EngineLoop(engine(folder), warm_up=False, stream_interval_s=-0.001)


def test_auto_coalesces_only_a_cpu_engine_whose_threads_fill_its_cores():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert auto_stream_interval(cpu, threads=2, cores=2) == AUTO_STREAM_INTERVAL_S == 0.025
    assert auto_stream_interval(cpu, threads=1, cores=1) == AUTO_STREAM_INTERVAL_S
    assert auto_stream_interval(cpu, threads=1, cores=2) == 0  # a core left for the messages
    assert auto_stream_interval(cuda, threads=16, cores=16) == 0  # the steps run on the GPU


@pytest.mark.parametrize("fill", [True, False])
def test_auto_is_decided_by_the_engine_thread_from_its_threads_and_cores(tiny_model, fill):
    """An EngineLoop told None (auto): with torch's threads as many as the cores this process may
    run on, it coalesces (how many messages then depends on the steps' speed: not asserted, the
    merging itself is above); with fewer (on a machine of one core: skipped), every token goes at
    once. The same tokens either way."""
    folder, _ = tiny_model("gqa_untied")
    cores = len(os.sched_getaffinity(0))
    if not fill and cores == 1:
        pytest.skip("one core: the engine's one thread always fills it")
    e = engine(folder)
    e.add_request(PROMPT, PARAMS, "r")
    expected = run_all(e)["r"]
    threads = torch.get_num_threads()
    torch.set_num_threads(cores if fill else cores - 1)
    try:
        loops: list[EngineLoop] = []
        outputs = streamed(folder, None, loops)
    finally:
        torch.set_num_threads(threads)
    assert [t for o in outputs for t in o.new_token_ids] == expected
    if fill:
        assert loops[0].stream_interval_s == AUTO_STREAM_INTERVAL_S
        assert len(outputs[0].new_token_ids) == 1  # the first at once
    else:
        assert loops[0].stream_interval_s == 0
        assert [len(o.new_token_ids) for o in outputs] == [1] * 12
