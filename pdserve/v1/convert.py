"""protobuf <-> pdserve dataclasses. Generated types stop at the servicers and clients."""

from __future__ import annotations

from pdserve.outputs import TokenLogprobs
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import common_pb2

# unset, these take SamplingParams' defaults
_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "logprobs")


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (-> INVALID_ARGUMENT) with the field and the allowed range."""
    return SamplingParams(
        top_k=p.top_k,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        **{name: getattr(p, name) for name in _OPTIONAL if p.HasField(name)},
    )


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    return p


def logprobs_to_proto(lp: TokenLogprobs | None) -> common_pb2.TokenLogprob | None:
    if lp is None:
        return None
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_proto(p: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(p.token_id, p.logprob, tuple((t.token_id, t.logprob) for t in p.top))
