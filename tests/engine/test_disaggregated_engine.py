"""Prefill in one engine, ship each layer's KV blocks, decode in another: same tokens as one engine."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import AdmissionError, LLMEngine
from pdserve.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 200, 33, 7, 8, 9, 10], [1] + list(range(40, 77)), [7] * 20]


def engine(folder, kv_bytes=1 << 22, block_size=4, prefix_caching=True, device="cpu"):
    cache = CacheConfig(block_size, kv_bytes, enable_prefix_caching=prefix_caching)
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", device=device, cache=cache))


def run_all(e: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


class CopySender:
    """A KVSender test double: keeps a copy of each layer's blocks, as a framed transfer sends
    them (``direct``: claims to read the pools after the call, so the engine must hold them)."""

    def __init__(self, num_blocks: int, direct: bool = False, fail_at: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.direct = direct
        self.fail_at = fail_at
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.token: int | None = None

    def send_pool_layer(self, layer, k_pool, v_pool, block_ids) -> None:
        if layer == self.fail_at:
            raise RuntimeError(f"send of layer {layer} failed")
        self.layers[layer] = (k_pool.index_select(0, block_ids), v_pool.index_select(0, block_ids))

    def finish(self, token_id: int = -1) -> None:
        self.token = token_id


def one_engine(folder, params: SamplingParams) -> dict[str, list[int]]:
    """Every prompt's tokens from one engine: what a disaggregated pair must produce."""
    whole = engine(folder)
    for i, p in enumerate(PROMPTS):
        whole.add_request(p, params, request_id=str(i))
    return run_all(whole)


def test_layerwise_shipped_kv_decodes_like_one_engine(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = one_engine(folder, params)

    prefill, decode = engine(folder), engine(folder)
    landings = {str(i): decode.reserve_request(p, params, str(i)) for i, p in enumerate(PROMPTS)}
    senders = {rid: CopySender(len(landing.block_ids)) for rid, landing in landings.items()}
    for i, p in enumerate(PROMPTS):
        prefill.add_prefill(p, params, str(i), senders[str(i)])
    first = {}
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            first[o.request_id] = o.new_token_ids[0]
    assert prefill.num_free_blocks == prefill.allocator.num_blocks  # nothing held: not direct

    got: dict[str, list[int]] = {}
    for rid, sender in senders.items():
        # every layer left, then the first token with finish()
        assert sorted(sender.layers) == list(range(decode.model_config.num_layers))
        assert sender.token == first[rid]
        landing = landings[rid]
        ids = torch.tensor(landing.block_ids)
        for layer, (k, v) in sender.layers.items():
            landing.k_pools[layer].index_copy_(0, ids, k)
            landing.v_pools[layer].index_copy_(0, ids, v)
        got[rid] = decode.activate_request(rid, first[rid]).new_token_ids
    for rid, toks in run_all(decode).items():
        got[rid] += toks
    assert got == expected
    assert decode.num_free_blocks == decode.allocator.num_blocks


def test_blocks_a_direct_sender_reads_stay_held_until_released(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = PROMPTS[1]  # 38 tokens: 10 blocks of 4
    sender = CopySender(10, direct=True)
    record = e.add_prefill(prompt, params, "a", sender)
    while e.has_unfinished_requests():
        e.step()
    assert record.error is None and sender.token is not None and record.first_send
    assert e.num_free_blocks == e.allocator.num_blocks - 10  # finished, but its blocks are read
    e.release_held("a")
    e.release_held("a")  # idempotent
    assert e.num_free_blocks == e.allocator.num_blocks

    # aborted after its first step: held just the same
    sender = CopySender(10, direct=True)
    e.add_prefill(prompt, params, "b", sender)
    e.step()
    e.abort_request("b")
    assert e.num_free_blocks == e.allocator.num_blocks - 10
    e.release_held("b")
    assert e.num_free_blocks == e.allocator.num_blocks


def test_a_failing_sender_is_reported_and_frees_everything(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    sender = CopySender(3, direct=False, fail_at=1)
    record = e.add_prefill(PROMPTS[0], SamplingParams(max_tokens=4), "a", sender)
    while e.has_unfinished_requests():
        e.step()
    assert isinstance(record.error, RuntimeError) and "layer 1" in str(record.error)
    assert sorted(sender.layers) == [0] and sender.token is None  # nothing after the failure
    assert e.num_free_blocks == e.allocator.num_blocks


def test_a_destination_of_the_wrong_size_is_refused(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    with pytest.raises(ValueError, match="destination has 2 blocks; the prompt fills 3"):
        e.add_prefill(PROMPTS[0], SamplingParams(max_tokens=4), "a", CopySender(2))
    assert not e.has_unfinished_requests() and e.num_free_blocks == e.allocator.num_blocks


def test_decode_admission_refuses_at_once_when_full_and_frees_on_abort(tiny_model):
    folder, _ = tiny_model("gqa_untied")
    from pdserve.kv_cache.pool import bytes_per_block
    from pdserve.model.config import ModelConfig

    cfg = ModelConfig.from_file(folder / "config.json")
    e = engine(folder, kv_bytes=6 * bytes_per_block(cfg, 4, torch.float32))  # 6 blocks of 4 tokens
    params = SamplingParams(max_tokens=8, temperature=0)
    # 9 + 7 = 16 tokens: 4 blocks reserved, the prompt's 3 to land in
    landing = e.reserve_request(list(range(1, 10)), params, "a")
    assert len(landing.block_ids) == 3 and e.num_free_blocks == 2
    with pytest.raises(AdmissionError, match="decode worker full: 2 KV blocks free"):
        e.reserve_request(list(range(1, 10)), params, "b")
    e.abort_request("a")
    assert e.num_free_blocks == 6
    e.reserve_request(list(range(1, 10)), params, "b")  # now it fits
    e.abort_request("b")
    assert e.num_free_blocks == 6


def test_a_landing_held_for_an_unsettled_transfer_stays_allocated_until_released(tiny_model):
    """Decode side: a reservation's generation is new every time; a request whose transfer has
    not settled is aborted at once but its prompt blocks stay held (not handed out again) until
    ``release_held``: a late write cannot reach a new owner."""
    folder, _ = tiny_model("gqa_untied")
    from pdserve.kv_cache.pool import bytes_per_block
    from pdserve.model.config import ModelConfig

    cfg = ModelConfig.from_file(folder / "config.json")
    e = engine(folder, kv_bytes=6 * bytes_per_block(cfg, 4, torch.float32))  # 6 blocks of 4 tokens
    params = SamplingParams(max_tokens=8, temperature=0)
    first = e.reserve_request(list(range(1, 10)), params, "a")  # 4 blocks, 3 for the prompt
    assert first.generation > 0
    e.hold_landing("a")
    e.abort_request("a")
    assert e.num_free_blocks == 3  # the 3 prompt blocks are held, the 4th is free
    with pytest.raises(AdmissionError):
        e.reserve_request(list(range(1, 10)), params, "b")
    e.release_held("a")
    assert e.num_free_blocks == 6
    second = e.reserve_request(list(range(1, 10)), params, "b")
    assert second.block_ids == first.block_ids and second.generation > first.generation
    e.abort_request("b")
    assert e.num_free_blocks == 6


def test_a_prefill_engine_may_borrow_only_while_every_prompt_is_for_an_idle_decode_worker(
    tiny_model,
):
    """``prompts_for_idle_decode``, what a prefill worker's EngineLoop borrows cores by: true with
    nothing to compute, and while each prompt waiting or computing was sent for a decode worker
    that runs nothing else (PrefillRequest.decode_idle); one that was not makes it false."""
    folder, _ = tiny_model("gqa_untied")
    e = engine(folder)
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = list(range(3, 13))  # 10 tokens: 3 blocks of 4
    assert e.prompts_for_idle_decode()
    e.add_prefill(prompt, params, "idle", CopySender(3), decode_idle=True)
    assert e.prompts_for_idle_decode()
    e.add_prefill([t + 50 for t in prompt], params, "busy", CopySender(3))
    assert not e.prompts_for_idle_decode()
    e.abort_request("busy")
    assert e.prompts_for_idle_decode()
    run_all(e)
    assert e.prompts_for_idle_decode()
