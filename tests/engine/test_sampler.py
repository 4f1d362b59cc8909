import pytest
import torch

from pdserve.sampler import SamplerRow, _sample_on_device, sample
from pdserve.sampling_params import SamplingParams
from tests.gpu import DEVICES


def row(**kw):
    p = SamplingParams(**kw)
    g = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return SamplerRow(p, g)


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    tokens, lps = sample(logits, [row(temperature=0), row(temperature=0)])
    assert tokens == [1, 0] and lps == [None, None]


def test_top_k_1_is_greedy_even_with_temperature():
    logits = torch.randn(4, 50)
    tokens, _ = sample(logits, [row(temperature=1.5, top_k=1, seed=i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    # probs ~ [0.64, 0.24, 0.09, 0.03]: top_p=0.5 leaves only token 0, top_p=0.8 tokens {0, 1}.
    logits = torch.log(torch.tensor([[0.64, 0.24, 0.09, 0.03]]))
    seen_05 = {sample(logits, [row(temperature=1, top_p=0.5, seed=s)])[0][0] for s in range(50)}
    seen_08 = {sample(logits, [row(temperature=1, top_p=0.8, seed=s)])[0][0] for s in range(200)}
    assert seen_05 == {0}
    assert seen_08 == {0, 1}


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    logits = torch.randn(3, 100)
    alone, _ = sample(logits[1:2], [row(temperature=1.0, seed=7)])
    batched, _ = sample(
        logits, [row(temperature=0.5, seed=1), row(temperature=1.0, seed=7), row(temperature=0)]
    )
    assert batched[1] == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    params = SamplingParams(temperature=1.0)
    for _ in range(3000):
        t, _ = sample(probs.log()[None], [SamplerRow(params, g)])
        counts[t[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    tokens, lps = sample(logits, [row(temperature=0, logprobs=2)])
    ref = torch.log_softmax(logits[0], -1)
    assert lps[0].token_id == 2 and lps[0].logprob == pytest.approx(ref[2].item())
    assert [t for t, _ in lps[0].top] == [2, 1]
    assert lps[0].top[1][1] == pytest.approx(ref[1].item())


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45])
def test_a_tiny_temperature_picks_the_best_token(temperature):
    """Not NaN's token 0: dividing the raw logits by it would overflow them to inf."""
    logits = torch.tensor([[1.0, 5.0, 3.0, 0.5], [2.0, -1.0, 9.0, 9.5]])
    rows = [row(temperature=temperature, seed=s) for s in (0, 1)]
    tokens, _ = sample(logits, rows)
    assert tokens == [1, 3]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
        (dict(temperature=-0.1), r"temperature must be a number in \[0, 2\] \(0 is greedy\)"),
        (dict(temperature=float("nan")), r"temperature must be a number in \[0, 2\].*got nan"),
        (dict(temperature=float("inf")), r"temperature must be a number in \[0, 2\].*got inf"),
        (dict(temperature=2.5), r"temperature must be a number in \[0, 2\].*got 2.5"),
        (dict(temperature="1"), r"temperature must be a number in \[0, 2\].*got '1'"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
        (dict(top_k=-1), r"top_k must be an integer in \[0, 2\*\*32\)"),
        (dict(top_k=2**32), r"top_k must be an integer in \[0, 2\*\*32\).*got 4294967296"),
        (dict(seed=2**63), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
        (dict(seed=1.5), r"seed must be None or an integer"),
        (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\], got 21"),
        (dict(logprobs=-1), r"logprobs must be None or an integer in \[0, 20\], got -1"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(stop=["s"] * 17), "stop takes at most 16 strings, got 17"),
        (dict(stop=["s" * 257]), "stop strings may have at most 256 characters, got one of 257"),
        (dict(stop=5), "stop must be a sequence, got 5"),
        (dict(stop_token_ids=[-3]), "stop_token_ids must be non-negative"),
        (dict(stop_token_ids=[1] * 257), "stop_token_ids takes at most 256 ids, got 257"),
        (dict(ignore_eos="yes"), "ignore_eos must be a boolean"),
    ],
)
def test_invalid_sampling_values_are_clear_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_values_at_the_limits_are_accepted():
    p = SamplingParams(
        temperature=2,
        top_k=2**32 - 1,
        top_p=1,
        seed=-(2**63),
        stop=["s" * 256] * 16,
        stop_token_ids=range(256),
        logprobs=20,
    )
    assert len(p.stop) == 16 and len(p.stop_token_ids) == 256


def test_an_error_message_stays_short_however_large_the_value():
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["x" * 100_000])
    assert len(str(e.value)) < 200


def mixed_rows(seed: int) -> list[SamplerRow]:
    """Greedy rows, seeded draws and logprobs, interleaved; made fresh (a generator is used up)."""
    return [
        row(temperature=0),
        row(temperature=0.8, seed=seed),
        row(temperature=0, logprobs=3),
        row(temperature=0),
        row(temperature=1.2, top_p=0.9, seed=seed + 1, logprobs=2),
        row(temperature=0),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_logits_on_a_device_sample_as_on_the_cpu(device):
    """On a GPU the greedy rows' argmax is taken there and only their ids come back; the rows that
    draw or want logprobs are sampled on the CPU with their own generators. Every row's token
    and logprobs are the CPU path's, whatever mix the batch has (on the CPU the device path's
    selection runs too, through ``_sample_on_device``)."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    for seed in range(5):
        want = sample(logits, mixed_rows(seed))
        assert _sample_on_device(logits.to(device), mixed_rows(seed)) == want
        assert sample(logits.to(device), mixed_rows(seed)) == want
    greedy = [row(temperature=0) for _ in range(6)]  # every row on the device
    assert _sample_on_device(logits.to(device), greedy) == (logits.argmax(-1).tolist(), [None] * 6)
    drawing = [row(temperature=1.0, seed=i) for i in range(6)]  # every row on the host
    assert _sample_on_device(logits.to(device), drawing) == sample(
        logits, [row(temperature=1.0, seed=i) for i in range(6)]
    )
