"""The sampler under test vs the ref twin (exactly) and vs independent oracles.

Oracles: a per-row plain-Python/float64 reimplementation of the filters and
penalties, torch.log_softmax for logprobs, a chi-square check of the sampling
distribution, and batch-independence of seeded requests.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from minivllm import backend
from minivllm.ref import sampler as ref_sampler
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata, pad_token_ids
from minivllm.sampling_params import SamplingParams


@pytest.fixture
def sampler():
    return backend.get("sampler")


def random_params(rng: random.Random, vocab_size: int) -> SamplingParams:
    """A random mix of every sampling option (each one on about half the time)."""
    def maybe(value, default):
        return value if rng.random() < 0.5 else default

    greedy = rng.random() < 0.25
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=maybe(rng.choice([1, 2, 5, 50, vocab_size + 7]), 0),
        top_p=maybe(rng.choice([0.05, 0.5, 0.9, 0.99]), 1.0),
        min_p=maybe(rng.choice([0.01, 0.1, 0.5]), 0.0),
        seed=maybe(rng.randrange(1 << 31), None),
        presence_penalty=maybe(rng.uniform(-2, 2), 0.0),
        frequency_penalty=maybe(rng.uniform(-2, 2), 0.0),
        repetition_penalty=maybe(rng.choice([0.5, 1.2, 2.0]), 1.0),
        min_tokens=maybe(rng.randrange(0, 4), 0),
        stop_token_ids=maybe([rng.randrange(vocab_size)], None),
        logprobs=maybe(rng.randrange(0, 6), None),
        max_tokens=None,
    )


def random_requests(rng: random.Random, num_rows: int, vocab_size: int) -> list[Request]:
    reqs = []
    for i in range(num_rows):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))]
        req = Request(f"r{i}", prompt, random_params(rng, vocab_size), eos_token_id=vocab_size - 1)
        for _ in range(rng.randrange(0, 12)):
            req.append_output_token_ids(rng.randrange(vocab_size))
        reqs.append(req)
    return reqs


def build(
    reqs: list[Request], vocab_size: int, seed: int = 0, device: str = "cpu"
) -> SamplingMetadata:
    """Fresh generators each call, so two builds draw the same numbers."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return SamplingMetadata.from_requests(reqs, vocab_size, device, gen, seeded_generators={})


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def random_logits(gen: torch.Generator, num_rows: int, vocab_size: int) -> torch.Tensor:
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 3.0  # (N, V)
    # Every other row is rounded to halves: many exact ties, to check tie handling.
    logits[::2] = torch.round(logits[::2] * 2) / 2
    return logits


# ---------------------------------------------------------------------------- twins


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_size", [1000, 32001])
@pytest.mark.parametrize("seed", range(4))
def test_matches_ref_exactly(sampler, vocab_size, seed, device):
    rng = random.Random(seed)
    reqs = random_requests(rng, rng.randrange(1, 9), vocab_size)
    logits = random_logits(torch.Generator().manual_seed(seed), len(reqs), vocab_size)
    logits = logits.to(device)
    before = logits.clone()

    # The twins' contract is exact: the same exponential race on the same draws, the same
    # stable tie-breaking. (Not a course test: a correct sampler may break ties otherwise;
    # tests/course/test_task_sampler_*.py grade behaviour, up to ties and rounding.)
    out = sampler.sample(logits, build(reqs, vocab_size, seed, device))
    want = ref_sampler.sample(logits, build(reqs, vocab_size, seed, device))
    assert torch.equal(logits, before), "sample() must not modify its input"
    assert torch.equal(out.sampled_token_ids, want.sampled_token_ids), (
        "the fast twin must pick exactly the ref's tokens (same draws, same ties)")
    assert (out.logprobs is None) == (want.logprobs is None)
    if want.logprobs is not None:
        for name in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
            assert torch.equal(getattr(out.logprobs, name), getattr(want.logprobs, name)), name

    md = build(reqs, vocab_size, seed, device)
    got_pen = sampler.apply_penalties(logits.clone(), md)
    want_pen = ref_sampler.apply_penalties(logits.clone(), md)
    assert torch.equal(got_pen, want_pen)
    assert torch.equal(sampler.filter_logits(want_pen, md), ref_sampler.filter_logits(want_pen, md))


# ---------------------------------------------------------------------------- oracles


def oracle_allowed(row: list[float], params: SamplingParams) -> set[int]:
    """The tokens a random row may sample, by definition, in float64 (vLLM v1 order)."""
    vocab_size = len(row)
    scaled = [x / params.temperature for x in row]
    m = max(scaled)
    probs = [math.exp(x - m) for x in scaled]
    total = sum(probs)
    probs = [p / total for p in probs]
    allowed = set(range(vocab_size))
    if params.min_p > 0:
        allowed = {i for i in allowed if probs[i] >= params.min_p * max(probs)}
    if params.top_k > 0:
        kth = sorted((scaled[i] for i in allowed), reverse=True)[min(params.top_k, len(allowed)) - 1]
        allowed = {i for i in allowed if scaled[i] >= kth}
    if params.top_p < 1:
        mass = sum(probs[i] for i in allowed)
        kept, before = set(), 0.0
        for i in sorted(allowed, key=lambda i: -scaled[i]):
            if before / mass >= params.top_p:
                break
            kept.add(i)
            before += probs[i]
        allowed = kept
    return allowed


@pytest.mark.parametrize("seed", range(6))
def test_filters_match_oracle(sampler, seed):
    rng = random.Random(100 + seed)
    vocab_size = rng.choice([37, 1000])
    reqs = random_requests(rng, 6, vocab_size)
    for r in reqs:  # filters only: penalties and min_tokens are checked below
        p = r.sampling_params
        p.temperature = p.temperature or 1.0
        p.presence_penalty = p.frequency_penalty = 0.0
        p.repetition_penalty, p.min_tokens = 1.0, 0
    logits = torch.randn(len(reqs), vocab_size, generator=torch.Generator().manual_seed(seed))
    md = build(reqs, vocab_size)
    filtered = sampler.filter_logits(logits, md)
    for i, r in enumerate(reqs):
        allowed = oracle_allowed(logits[i].double().tolist(), r.sampling_params)
        got = set(torch.isfinite(filtered[i]).nonzero().flatten().tolist())
        assert got == allowed, (
            f"row {i}: filter_logits kept {len(got)} tokens, the definition keeps "
            f"{len(allowed)} ({len(got - allowed)} extra, {len(allowed - got)} missing) for "
            f"{r.sampling_params}")


@pytest.mark.parametrize("seed", range(6))
def test_sampled_tokens_pass_the_filters(sampler, seed):
    """sample() draws only tokens the filters allow (the oracle's set, untied logits)."""
    rng = random.Random(100 + seed)
    vocab_size = rng.choice([37, 1000])
    reqs = random_requests(rng, 6, vocab_size)
    for r in reqs:
        p = r.sampling_params
        p.temperature = p.temperature or 1.0
        p.presence_penalty = p.frequency_penalty = 0.0
        p.repetition_penalty, p.min_tokens = 1.0, 0
    logits = torch.randn(len(reqs), vocab_size, generator=torch.Generator().manual_seed(seed))
    sampled = sampler.sample(logits, build(reqs, vocab_size)).sampled_token_ids
    for i, r in enumerate(reqs):
        allowed = oracle_allowed(logits[i].double().tolist(), r.sampling_params)
        assert int(sampled[i]) in allowed, f"row {i}: sampled a filtered token"


def test_penalties_match_oracle(sampler):
    rng = random.Random(7)
    vocab_size = 53
    reqs = random_requests(rng, 8, vocab_size)
    logits = torch.randn(len(reqs), vocab_size, generator=torch.Generator().manual_seed(7))
    got = sampler.apply_penalties(logits.clone(), build(reqs, vocab_size))
    for i, r in enumerate(reqs):
        p = r.sampling_params
        for t in range(vocab_size):
            x = float(logits[i, t])
            if t in r.prompt_token_ids or t in r.output_token_ids:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = r.output_token_ids.count(t)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            if r.num_output_tokens < p.min_tokens and t in {*p.stop_token_ids, r.eos_token_id}:
                x = float("-inf")
            # float32 rounding of a few operations on values of this size; the order in
            # which penalties are applied (or folded) may change the last bits.
            tol = 8 * 2**-24 * (abs(float(logits[i, t])) * max(p.repetition_penalty, 1)
                                + abs(p.frequency_penalty) * count + abs(p.presence_penalty))
            assert float(got[i, t]) == pytest.approx(x, abs=tol + 1e-7), (
                f"row {i}, token {t}: penalised logit {float(got[i, t])}, the formula gives {x}")


def test_greedy_is_argmax(sampler):
    vocab_size = 32001
    reqs = [Request(f"g{i}", [1], SamplingParams(temperature=0.0)) for i in range(5)]
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(3))
    out = sampler.sample(logits, build(reqs, vocab_size))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    # Greedy rows inside a mixed batch too.
    reqs[1].sampling_params = SamplingParams(temperature=1.0, top_p=0.5)
    out = sampler.sample(logits, build(reqs, vocab_size))
    for i in (0, 2, 3, 4):
        assert int(out.sampled_token_ids[i]) == int(logits[i].argmax())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(sampler, temperature):
    vocab_size, eos, stop = 101, 100, 7
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[stop])
    req = Request("m", [1, 2], params, eos_token_id=eos)
    logits = torch.zeros(1, vocab_size)
    logits[0, eos] = logits[0, stop] = 50.0  # overwhelmingly likely unless masked
    for step in range(5):
        token = int(sampler.sample(logits, build([req], vocab_size, step)).sampled_token_ids[0])
        if step < 3:
            assert token not in (eos, stop)
        else:
            assert token in (eos, stop)
        req.append_output_token_ids(token)


def test_logprobs_are_raw_log_softmax(sampler):
    vocab_size = 1000
    rng = random.Random(11)
    reqs = random_requests(rng, 6, vocab_size)
    for r in reqs:
        r.sampling_params.logprobs = 4
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(11)) * 2
    out = sampler.sample(logits, build(reqs, vocab_size))
    lp = out.logprobs
    want = torch.log_softmax(logits.double(), dim=-1)  # raw: no temperature, no penalties
    assert lp.logprob_token_ids.shape == (6, 5)
    assert torch.equal(lp.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(
        lp.logprobs.double(), want.gather(1, lp.logprob_token_ids), atol=1e-5, rtol=0
    )
    order = want.argsort(dim=-1, descending=True)
    assert torch.equal(lp.logprob_token_ids[:, 1:], order[:, :4])
    for i in range(6):
        rank = 1 + int((order[i] == out.sampled_token_ids[i]).nonzero())
        assert int(lp.selected_token_ranks[i]) == rank


# ---------------------------------------------------------------------------- randomness


@pytest.mark.parametrize("seed", range(2))
def test_distribution_chi_square(sampler, seed):
    """Many independent rows of one config: frequencies match the filtered softmax."""
    vocab_size, num_samples = 40, 6000
    params = SamplingParams(temperature=0.8, top_k=25, top_p=0.95, min_p=0.02)
    row = torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * 1.5
    allowed = sorted(oracle_allowed(row.double().tolist(), params))
    scaled = row.double()[allowed] / params.temperature
    expected = torch.softmax(scaled, dim=0) * num_samples  # (len(allowed),)

    reqs = [Request(f"s{i}", [0], params) for i in range(num_samples)]
    out = sampler.sample(row.expand(num_samples, -1), build(reqs, vocab_size, seed))
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab_size).double()
    assert counts.sum() == counts[allowed].sum(), "sampled a filtered token"
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    dof = len(allowed) - 1
    # Loose: the 99.99th percentile of chi2(dof) is below dof + 8 * sqrt(2 dof) + 10.
    assert chi2 < dof + 8 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_ignores_batch(sampler, device):
    """A seeded request yields the same tokens alone and at any position in a batch."""
    vocab_size, steps = 1000, 5
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    logits_per_step = [
        torch.randn(vocab_size, generator=torch.Generator().manual_seed(s)).to(device)
        for s in range(steps)
    ]

    def run(num_others: int, position: int, engine_seed: int) -> list[int]:
        me = Request("me", [1], params)
        others = [
            Request(f"o{i}", [2], SamplingParams(temperature=1.0, seed=i if i % 2 else None))
            for i in range(num_others)
        ]
        batch = others[:position] + [me] + others[position:]
        gen = torch.Generator(device=device).manual_seed(engine_seed)
        seeded: dict[str, torch.Generator] = {}
        for step in range(steps):
            logits = torch.randn(len(batch), vocab_size, generator=gen, device=device)
            logits[position] = logits_per_step[step]
            md = SamplingMetadata.from_requests(batch, vocab_size, device, gen, seeded)
            tokens = sampler.sample(logits, md).sampled_token_ids
            for r, t in zip(batch, tokens.tolist()):
                r.append_output_token_ids(t)
        return me.output_token_ids

    alone = run(0, 0, engine_seed=0)
    assert run(3, 2, engine_seed=1) == alone
    assert run(5, 0, engine_seed=2) == alone
    params.seed = 99  # another seed must give another sequence (5 tokens out of 1000)
    assert run(0, 0, engine_seed=0) != alone


def test_pad_token_ids():
    rows = [[3, 1], [], [5, 5, 5, 9]]
    got = pad_token_ids(rows, 42, "cpu")
    want = torch.full((3, 4), 42)
    for i, r in enumerate(rows):
        want[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    assert torch.equal(got, want)
    assert pad_token_ids([[], []], 7, "cpu").tolist() == [[7], [7]]


def test_seed_needs_generator_store():
    req = Request("x", [1], SamplingParams(seed=3))
    with pytest.raises(ValueError, match="seeded_generators"):
        SamplingMetadata.from_requests([req], 10, "cpu")
