"""Course task: penalties and logprobs, called directly, against the definitions."""

from __future__ import annotations

import torch

from minivllm import backend
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams


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
