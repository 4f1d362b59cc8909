"""One prompt validation: the gateway and an engine refuse the same prompts with the same
messages."""

from __future__ import annotations

import asyncio

import pytest
from pdserve.services.gateway.gateway import Gateway
from pdserve.services.gateway.prompt import Prompt

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.validation import validate_prompt

MAX_MODEL_LEN = 512  # the tiny models' max_position_embeddings
VOCAB_SIZE = 512

CASES = [
    ([], 16, "prompt is empty; give at least one token"),
    (
        [5] * 500,
        16,
        "prompt has 500 tokens and max_tokens is 16: 516 exceeds this model's context of 512 tokens",
    ),
    ([5, 7, 512, 3], 16, "prompt token id 512 is outside the vocabulary [0, 512)"),
    ([5, -1], 16, "prompt token id -1 is outside the vocabulary [0, 512)"),
]


@pytest.fixture(scope="module")
def engine(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = LLMEngine(EngineConfig(model=str(folder), dtype="float32"), detokenize=False)
    assert (e.max_model_len, e.model_config.vocab_size) == (MAX_MODEL_LEN, VOCAB_SIZE)
    return e


@pytest.fixture(scope="module")
def gateway(default_model_dir):
    return Gateway(Tokenizer.from_folder(default_model_dir), MAX_MODEL_LEN, VOCAB_SIZE, "tiny")


def gateway_error(gw: Gateway, ids: list[int], params: SamplingParams) -> str:
    async def run():
        with gw.open("r", (), stream=False) as req:
            async for _ in gw.generate(req, Prompt(token_ids=tuple(ids)), params):
                pass

    with pytest.raises(ValueError) as err:
        asyncio.run(run())
    return str(err.value)


@pytest.mark.parametrize("ids, max_tokens, message", CASES)
def test_gateway_and_engine_refuse_alike(engine, gateway, ids, max_tokens, message):
    params = SamplingParams(max_tokens=max_tokens)
    with pytest.raises(ValueError) as err:
        validate_prompt(ids, max_tokens, MAX_MODEL_LEN, VOCAB_SIZE)
    assert str(err.value) == message
    with pytest.raises(ValueError) as from_engine:
        engine.add_request(ids, params)
    assert str(from_engine.value) == message
    with pytest.raises(ValueError) as reserved:
        engine.reserve_request(ids, params, "d")
    assert str(reserved.value) == message
    assert gateway_error(gateway, ids, params) == message
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.stats().num_total_blocks  # nothing leaked


def test_a_prompt_that_just_fits_passes():
    validate_prompt([0, 511] + [5] * 494, 16, MAX_MODEL_LEN, VOCAB_SIZE)
