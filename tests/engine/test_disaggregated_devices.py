"""A prefill and a decode engine on their own devices, the KV between them over real UCX, each
transport made as a worker makes it for its ``--device`` (services/main.py): the decode side's
tokens are the tokens of one engine. The CPU pair runs everywhere; those with a GPU (marked gpu)
prove that CUDA pools go over UCX as CUDA memory and land where decode reads them."""

from __future__ import annotations

import pytest
from pdserve.services.main import WorkerOptions, _transport_options, kv_layout

from pdserve.config import EngineConfig
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import PoolDestination, create_transport
from tests.engine.test_disaggregated_engine import PROMPTS, engine, one_engine, run_all
from tests.gpu import DEVICE_PAIRS

TIMEOUT_S = 30.0


def transport_for(role: str, folder, device: str, layout):
    """The KV transport a ``role`` worker with ``--device device`` makes."""
    config = EngineConfig(model=str(folder), device=device)
    opts = WorkerOptions(role=role, engine=config, transport="ucx")
    return create_transport("ucx", layout, **_transport_options(opts))


@pytest.mark.parametrize("src, dst", DEVICE_PAIRS)
def test_kv_over_ucx_between_devices_decodes_like_one_engine(tiny_model, src, dst):
    folder, _ = tiny_model("gqa_untied")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = one_engine(folder, params)

    prefill, decode = engine(folder, device=src), engine(folder, device=dst)
    layout = kv_layout(prefill, "tiny")
    with (
        transport_for("prefill", folder, src, layout) as sending,
        transport_for("decode", folder, dst, layout) as receiving,
    ):
        assert (sending.device.type, receiving.device.type) == (src, dst)
        peer = sending.connect(receiving.address())
        recvs, sends, outgoing = {}, {}, {}
        for i, p in enumerate(PROMPTS):
            rid = str(i)
            landing = decode.reserve_request(p, params, rid)
            assert landing.k_pools[0].device.type == dst
            dest = PoolDestination(landing.k_pools, landing.v_pools, landing.block_ids)
            recvs[rid] = receiving.expect(landing.generation, dest, TIMEOUT_S)
            sends[rid] = sending.start_send(
                peer,
                landing.generation,
                len(landing.block_ids),
                TIMEOUT_S,
                dst_block_ids=landing.block_ids,
            )
            outgoing[rid] = prefill.add_prefill(p, params, rid, sends[rid])
        first = {}
        while prefill.has_unfinished_requests():
            for o in prefill.step():
                first[o.request_id] = o.new_token_ids[0]
        # a send that failed is recorded for the prefill worker, which answers with it
        assert {rid: out.error for rid, out in outgoing.items()} == dict.fromkeys(outgoing)
        got = {}
        for rid, recv in recvs.items():
            sends[rid].wait()
            prefill.release_held(rid)  # a direct transfer read the pools until now
            recv.wait()
            assert recv.token_id == first[rid]
            got[rid] = decode.activate_request(rid, first[rid]).new_token_ids
    for rid, toks in run_all(decode).items():
        got[rid] += toks
    assert got == expected
    assert decode.num_free_blocks == decode.allocator.num_blocks
    assert prefill.num_free_blocks == prefill.allocator.num_blocks
