"""Course task: penalties and logprobs, called directly, against the definitions."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from minivllm import backend
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the sampler oracles
from test_sampler import build, oracle_allowed, random_logits, random_requests  # noqa: E402


def test_repetition_penalty_counts_prompt_and_output():
    vocab = 6
    req = Request("r", [1, 2], SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                              presence_penalty=0.25), eos_token_id=5)
    for t in (2, 3, 3):
        req.append_output_token_ids(t)
    md = SamplingMetadata.from_requests([req], vocab, "cpu", torch.Generator().manual_seed(0),
                                        seeded_generators={})
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0, 0.5, -1.0]])
    got = backend.get("sampler").apply_penalties(logits.clone(), md)[0].tolist()
    # token 1: prompt only; 2: prompt and output once; 3: output twice; 0, 4, 5: unseen.
    want = [1.0, 4.0 / 2, -2.0 * 2 - 0.5 - 0.25, 3.0 / 2 - 1.0 - 0.25, 0.5, -1.0]
    for t, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) < 1e-6, f"token {t}: penalised logit {g}, expected {w}"


def test_logprob_rank_counts_ties():
    logprobs = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.3, 0.2]]))
    out = backend.get("sampler").gather_logprobs(logprobs, torch.tensor([1, 0]), 1)
    assert out.selected_token_ranks.tolist() == [3, 1], (
        "rank = how many tokens are at least as likely as the sampled one (1 = the best)")
    assert out.logprob_token_ids.tolist() == [[1, 2], [0, 0]]


def _oracle_may_sample(row: list[float], params) -> set[int]:
    """The oracle's allowed set, widened by the tokens tied with its least likely member
    (a correct top-p may keep another member of a tie group at the boundary)."""
    allowed = oracle_allowed(row, params)
    if not allowed or params.temperature == 0:
        return allowed
    low = min(row[i] for i in allowed)
    return allowed | {i for i, x in enumerate(row) if x == low}


def _penalised(req, row: list[float]) -> list[float]:
    """The penalties and min_tokens by their definitions, in float64."""
    p, out = req.sampling_params, []
    for t, x in enumerate(row):
        if t in req.prompt_token_ids or t in req.output_token_ids:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = req.output_token_ids.count(t)
        x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        if req.num_output_tokens < p.min_tokens and t in {*p.stop_token_ids, req.eos_token_id}:
            x = float("-inf")
        out.append(x)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_sample_follows_the_definitions_up_to_ties(seed):
    """Every option at once, on logits with exact ties: the sampled token is one the
    definitions allow, greedy rows take the (untied) argmax exactly, logprobs are the raw
    log-softmax, and the rank counts the tokens at least as likely (integer contracts)."""
    rng = random.Random(seed)
    vocab_size = rng.choice([50, 1000])
    reqs = random_requests(rng, 8, vocab_size)
    logits = random_logits(torch.Generator().manual_seed(seed), len(reqs), vocab_size)
    before = logits.clone()
    out = backend.get("sampler").sample(logits, build(reqs, vocab_size, seed))
    assert torch.equal(logits, before), "sample() must not modify its input"
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, r in enumerate(reqs):
        token, params = int(out.sampled_token_ids[i]), r.sampling_params
        pen = _penalised(r, logits[i].double().tolist())
        if params.temperature == 0:
            best = max(pen)
            if pen.count(best) == 1:  # exact: greedy on an untied maximum
                assert token == pen.index(best), f"row {i}: greedy must take the argmax"
        else:
            assert token in _oracle_may_sample(pen, params), (
                f"row {i}: sampled token {token}, which {params} filters out")
        if out.logprobs is not None and params.logprobs is not None:
            lp = out.logprobs
            assert int(lp.logprob_token_ids[i, 0]) == token
            k = lp.logprob_token_ids.shape[1] - 1
            torch.testing.assert_close(lp.logprobs[i, 0].double(), raw[i, token],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(  # the k best values; which tie is named may differ
                lp.logprobs[i, 1:].double(), raw[i].topk(k).values, atol=1e-5, rtol=0)
            assert int(lp.selected_token_ranks[i]) == int((raw[i] >= raw[i, token]).sum()), (
                f"row {i}: rank = how many tokens are at least as likely as the sampled one")
