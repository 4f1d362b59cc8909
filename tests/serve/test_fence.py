"""Fenced KV blocks through the services (pdserve/transfer/fence.py): a prefill worker that sends
a request's KV after the decode worker gave that request up, and handed its blocks to another
request, changes nothing for the new owner; its KV is dropped and counted. Driven below the
gateway (Decode.Generate, Prefill.Prefill), as the gateway drives them."""

from __future__ import annotations

import grpc

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import assert_no_leaks, wait_until

SAMPLING = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT_A = list(range(100, 160))  # 60 tokens: 4 blocks of 16
PROMPT_B = list(range(300, 360))


def _admit(dch: grpc.Channel, request_id: str, prompt: list[int]):  # noqa: ANN202
    call = worker_pb2_grpc.DecodeStub(dch).Generate(
        worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=SAMPLING, kv_timeout_ms=20000
        ),
        timeout=30,
    )
    return call, next(call).admitted.destination


def _prefill(pch: grpc.Channel, request_id: str, prompt: list[int], dest) -> int:  # noqa: ANN001
    response = worker_pb2_grpc.PrefillStub(pch).Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=SAMPLING, destination=dest
        ),
        timeout=30,
    )
    return response.first_token.token_id


def _tokens(call) -> list[int]:  # noqa: ANN001
    return [t for r in call for t in r.tokens.token_ids]


def test_a_late_prefill_into_a_reused_reservation_is_dropped_and_counted(cluster) -> None:
    c = cluster(prefill=1, decode=0)
    # no prefix reuse: B's second reservation would share the blocks of its reference run
    decode = c.start_worker("decode-0", "decode", prefix_caching=False)
    d_addr, p_addr = decode.address, c.workers["prefill-0"].address

    def stale() -> float:
        value = decode.worker.metrics.registry.get_sample_value("pdserve_kv_stale_messages_total")
        return value or 0.0

    with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
        # the undisturbed run of B, for reference
        call, dest = _admit(dch, "reference", PROMPT_B)
        reference = [_prefill(pch, "reference", PROMPT_B, dest), *_tokens(call)]

        # A is admitted, then given up (the client went away) before its KV came
        call_a, dest_a = _admit(dch, "a", PROMPT_A)
        call_a.cancel()
        total = decode.worker.engine.stats().num_total_blocks
        wait_until(lambda: decode.worker.engine.num_free_blocks == total, 10, "A's blocks freed")

        # B gets A's blocks, under a new generation
        call_b, dest_b = _admit(dch, "b", PROMPT_B)
        assert list(dest_b.block_ids) == list(dest_a.block_ids)
        assert int(dest_b.transfer_id) > int(dest_a.transfer_id)

        # A's prefill arrives late, aimed at the blocks B now owns
        _prefill(pch, "a-late", PROMPT_A, dest_a)
        layers = len(decode.worker.engine.runner.pool.kv_caches)
        wait_until(lambda: stale() == layers, 10, "A's late KV to be counted stale")

        # B's own KV lands and decodes exactly like the undisturbed run
        assert [_prefill(pch, "b", PROMPT_B, dest_b), *_tokens(call_b)] == reference
    assert stale() == layers
    assert_no_leaks(c.live())
