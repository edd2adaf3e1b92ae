"""The draft-model proposer, standalone: its drafts and ``q`` against transformers.

- Self-speculation with every layer: the drafts are the target's own greedy
  continuation (transformers' greedy loop).
- With the first ``L`` layers: the drafts are the greedy continuation of
  transformers' model loaded with ``num_hidden_layers=L`` (the same weights
  cut after layer ``L``, then the final norm and LM head), and for a random
  request ``q`` equals ``softmax(filter(logits))`` of that model.
- The batched proposer equals the one-token-at-a-time reference loop, on a
  mixed batch (k of 0, 1, 3, 5, greedy and seeded random requests).
- A separate draft model (its own KV cache on the target's block ids) over
  several rounds of greedy verification, with rejections, still drafts
  exactly its own greedy continuation.

Run: ``CI=true pytest -q tests/test_draft_model.py --backend=ref`` (and ``--backend=fast``).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_model

from minivllm import SamplingParams
from minivllm.engine.config import WorkerConfig
from minivllm.metadata import StepInput
from minivllm.request import Request
from minivllm.spec_decode.draft_model import DraftModelProposer, propose_one_by_one
from minivllm.worker.worker import Worker

BLOCK_SIZE = 4


def make_worker(path) -> Worker:
    worker = Worker(WorkerConfig(str(path), torch.float32, "cpu"))
    worker.init_kv_cache(num_blocks=96, block_size=BLOCK_SIZE, max_num_reqs=8,
                         max_num_blocks_per_req=24)
    return worker


def hf_logits(model, tokens: list[int]) -> torch.Tensor:  # (V,) after the whole sequence
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def hf_greedy(model, tokens: list[int], n: int) -> list[int]:
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq).argmax()))
    return seq[len(tokens):]


class Batch:
    """Requests prefilled by the target (the worker) and sampled greedily, as the engine would."""

    def __init__(self, worker: Worker, prompts, params, seed: int = 0) -> None:
        self.worker = worker
        rng = random.Random(seed)
        free = list(range(worker.kv_caches[0][0].shape[0]))
        rng.shuffle(free)  # scattered block tables
        self.requests = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        blocks = []
        for r in self.requests:
            need = -(-(r.num_tokens + 16) // BLOCK_SIZE)  # room for 16 more positions
            blocks.append(tuple(free.pop() for _ in range(need)))
        ids = [t for r in self.requests for t in r.all_token_ids]
        positions = [p for r in self.requests for p in range(r.num_tokens)]
        ends = torch.tensor([r.num_tokens for r in self.requests]).cumsum(0) - 1
        step = StepInput(
            req_ids=tuple(r.request_id for r in self.requests),
            new_req_ids=frozenset(r.request_id for r in self.requests),
            new_block_ids=tuple(blocks), removed_req_ids=(),
            query_lens=tuple(r.num_tokens for r in self.requests),
            seq_lens=tuple(r.num_tokens for r in self.requests),
            input_ids=torch.tensor(ids), positions=torch.tensor(positions),
            logits_indices=ends,
        )
        logits = worker.execute_model(step).logits  # the target's prefill
        for r, row in zip(self.requests, logits):
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(int(row.argmax()))


def test_all_layers_draft_the_targets_greedy_tokens(tiny_model_dir):
    path = tiny_model_dir("llama", num_hidden_layers=3)
    worker = make_worker(path)
    prompts = [[5, 17, 200, 3, 99], [42] * 11, [7, 8]]
    batch = Batch(worker, prompts, [SamplingParams(temperature=0.0)] * 3)
    proposer = DraftModelProposer.self_speculation(worker, None)
    k = 5
    drafts_per_request, draft_probs = proposer.propose(batch.requests, [k] * 3)
    oracle = hf_model(path)
    for r, drafts in zip(batch.requests, drafts_per_request):
        want = hf_greedy(oracle, r.prompt_token_ids, k + 1)
        assert [r.output_token_ids[0], *drafts] == want
    assert draft_probs.shape == (3 * k, worker.model.config.vocab_size)
    assert torch.equal(draft_probs.sum(-1), torch.ones(3 * k))  # one-hot for greedy


@pytest.mark.parametrize("arch,layers", [("llama", 1), ("qwen2", 2), ("llama_tied", 2)])
def test_first_layers_match_a_truncated_transformers_model(tiny_model_dir, arch, layers):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch, num_hidden_layers=3)
    worker = make_worker(path)
    prompts = [[1, 2, 3, 250, 9, 9, 4], [300, 12]]
    random_params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3)
    batch = Batch(worker, prompts, [SamplingParams(temperature=0.0), random_params])
    proposer = DraftModelProposer.self_speculation(worker, layers)
    k = 4
    drafts, draft_probs = proposer.propose(batch.requests, [k, k])
    cut = AutoModelForCausalLM.from_pretrained(
        path, num_hidden_layers=layers, dtype=torch.float32, attn_implementation="eager",
        local_files_only=True).eval()
    greedy_req, random_req = batch.requests
    greedy_drafts, random_drafts = drafts
    assert greedy_drafts == hf_greedy(cut, greedy_req.all_token_ids, k)
    # The random request: q is the cut model's filtered distribution after each prefix.
    assert len(random_drafts) == k
    for j in range(k):
        logits = hf_logits(cut, random_req.all_token_ids + random_drafts[:j]) / 0.7
        kth = logits.topk(40).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        order = probs.sort(descending=True)
        keep = (order.values.cumsum(0) - order.values) < 0.9  # top-p keeps the head
        want = torch.zeros_like(probs)
        want[order.indices[keep]] = probs[order.indices[keep]]
        want /= want.sum()
        q = draft_probs[k + j]
        torch.testing.assert_close(q, want, atol=2e-5, rtol=1e-4)
        assert q[random_drafts[j]] > 0


def test_batched_equals_one_by_one(tiny_model_dir):
    path = tiny_model_dir("llama", num_hidden_layers=3)
    worker = make_worker(path)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6] * 9, [27, 18], [100, 200, 300], [11, 12, 13, 14, 15]]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=7, seed=2),
              SamplingParams(temperature=0.5, min_p=0.05, seed=9)]
    batch = Batch(worker, prompts, params)
    ks = [3, 5, 0, 1, 5]
    batched = DraftModelProposer.self_speculation(worker, 2).propose(batch.requests, ks)
    looped = propose_one_by_one(DraftModelProposer.self_speculation(worker, 2), batch.requests,
                                ks)
    assert batched[0] == looped[0]
    assert [len(d) for d in batched[0]] == ks
    torch.testing.assert_close(batched[1], looped[1], atol=1e-5, rtol=1e-4)


def test_lookahead_cap_and_bad_layers(tiny_model_dir):
    path = tiny_model_dir("llama", num_hidden_layers=3)
    worker = make_worker(path)
    batch = Batch(worker, [[1, 2, 3]], [SamplingParams(temperature=0.0)])
    proposer = DraftModelProposer.self_speculation(worker, 1)
    r = batch.requests[0]
    capacity = len(worker.block_tables.get_block_ids(r.request_id)) * BLOCK_SIZE
    assert proposer.drafts_that_fit(r, 32) == capacity - r.num_tokens + 1
    with pytest.raises(ValueError, match="num_draft_layers"):
        worker.model.first_layers(4)
    with pytest.raises(ValueError, match="num_draft_layers"):
        worker.model.first_layers(0)


def test_first_layers_share_the_weights(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama", num_hidden_layers=3))
    view = worker.model.first_layers(2)
    assert len(view.model.layers) == 2 and len(worker.model.model.layers) == 3
    mine = {id(p) for p in view.parameters()}
    assert mine <= {id(p) for p in worker.model.parameters()}


def test_separate_draft_model_over_rounds(tiny_model_dir):
    """A different model as the draft: its own cache, prefilled once, kept over rounds."""
    target_path = tiny_model_dir("llama", num_hidden_layers=2)
    draft_path = tiny_model_dir("llama", seed=1, num_hidden_layers=2)
    worker = make_worker(target_path)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    batch = Batch(worker, [prompt], [SamplingParams(temperature=0.0)])
    r = batch.requests[0]
    target, draft = hf_model(target_path), hf_model(draft_path)
    truth = hf_greedy(target, prompt, 12)  # what greedy verification will emit
    assert truth[0] == r.output_token_ids[0]
    proposer = DraftModelProposer.separate(worker, str(draft_path))
    k = 3
    rounds = 0
    while r.num_output_tokens < 9:
        drafts = proposer.propose([r], [k])[0][0]
        assert drafts == hf_greedy(draft, r.all_token_ids, k), f"round {rounds}"
        # Greedy verification against the target's own continuation.
        done = r.num_output_tokens
        accepted = 0
        while accepted < k and drafts[accepted] == truth[done + accepted]:
            accepted += 1
        for t in truth[done : done + accepted + 1]:
            r.append_output_token_ids(t)
        r.num_computed_tokens = r.num_tokens - 1
        rounds += 1
    assert rounds >= 3
    # A preemption (the worker drops its row) voids the draft's cache: from position 0.
    assert proposer.first_uncached(r) == r.num_tokens - 1
    proposer.invalidate(r.request_id)
    assert proposer.first_uncached(r) == 0
