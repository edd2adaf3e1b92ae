"""``SamplingParams(prompt_logprobs=k)`` against transformers' full forward (the oracle).

vLLM's contract: ``RequestOutput.prompt_logprobs`` has one entry per prompt
token, None for the first, and for token ``j`` a ``{token_id: Logprob}`` holding
the prompt token itself (its rank: how many tokens are at least as likely)
plus the ``k`` most likely tokens at position ``j - 1``; the values are the
log-softmax of the raw logits. The oracle here is transformers' forward over
the whole prompt, in one piece: nothing is shared with the engine's chunks,
paged cache or prefix cache. Runs under ``--backend=ref|fast``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model
from test_engine import greedy, make_llm, random_prompts

from minivllm import SamplingParams
from minivllm.sampling_params import RequestOutputKind


def oracle(path, prompt: list[int]) -> torch.Tensor:
    """``(len(prompt) - 1, vocab)``: row ``j - 1`` is the log-distribution of token ``j``."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


def check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """The engine's entries against the oracle's rows, entry by entry."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry, row, tok = prompt_logprobs[j], ref[j - 1], prompt[j]
        top = torch.topk(row, k) if k else None
        want_ids = ({tok} | set(top.indices.tolist())) if k else {tok}
        assert set(entry) == want_ids, f"token {j}"
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert entry[tok].rank == int((row >= row[tok]).sum())
        if k:
            for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                assert entry[t].logprob == pytest.approx(v, abs=1e-4)
                if t != tok:
                    assert entry[t].rank == r


# (arch, block_size, engine overrides, prompt lengths): a 1-token prompt, odd lengths,
# lengths on and across block boundaries, chunked prefill with tiny budgets.
CASES = [
    ("llama", 4, {}, [1, 2, 7, 8, 9]),
    ("qwen2", 3, {"max_num_batched_tokens": 5}, [1, 6, 13]),  # chunks of 5: 13 = 5+5+3
    ("llama_tied", 16, {"max_num_batched_tokens": 16}, [16, 17, 33]),
]


@pytest.mark.parametrize("arch,block_size,overrides,lengths", CASES)
def test_prompt_logprobs_match_transformers(tiny_model_dir, arch, block_size, overrides,
                                            lengths):
    path = tiny_model_dir(arch)
    prompts = random_prompts(len(lengths), lengths, seed=len(lengths) + block_size)
    llm = make_llm(path, block_size=block_size, **overrides)
    k = 3
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        greedy(2, prompt_logprobs=k), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check(out.prompt_logprobs, prompt, oracle(path, prompt), k)
        assert out.outputs[0].logprobs is None  # prompt_logprobs does not turn logprobs on


def test_batch_mixing_requests_with_and_without_prompt_logprobs(tiny_model_dir):
    """Per-request: k = 0 (the prompt token alone), 5, off, -1 under max_logprobs=-1;
    chunked prefill splits the batch's prompts differently each step; the sampled
    tokens are the same as without prompt logprobs."""
    path = tiny_model_dir("llama")
    prompts = random_prompts(4, [11, 5, 20, 3], seed=3)
    llm = make_llm(path, block_size=4, max_num_batched_tokens=8, max_logprobs=-1)
    ks = [0, 5, None, -1]
    params = [greedy(4, prompt_logprobs=k, logprobs=2) for k in ks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4, logprobs=2),
                         use_tqdm=False)
    for prompt, k, out, base in zip(prompts, ks, outs, plain):
        assert out.outputs[0].token_ids == base.outputs[0].token_ids
        for a, b in zip(out.outputs[0].logprobs, base.outputs[0].logprobs):
            assert {t: v.logprob for t, v in a.items()} == pytest.approx(
                {t: v.logprob for t, v in b.items()}, abs=1e-5)
        ref = oracle(path, prompt)
        if k is None:
            assert out.prompt_logprobs is None
        elif k == -1:
            vocab = ref.shape[-1]
            assert all(len(e) == vocab for e in out.prompt_logprobs[1:])
            got = torch.tensor([[e[t].logprob for t in range(vocab)]
                                for e in out.prompt_logprobs[1:]])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        else:
            check(out.prompt_logprobs, prompt, ref, k)


def test_prefix_cache_is_not_read_and_preemption_recomputes(tiny_model_dir):
    """A prompt already in the prefix cache: the request asking for prompt logprobs
    reads no hit (num_cached_tokens 0) and still gets every entry; a pool so small that
    requests are preempted mid-prompt gives the same entries."""
    path = tiny_model_dir("qwen3")
    prompt = random_prompts(1, [21], seed=8)[0]
    ref = oracle(path, prompt)
    llm = make_llm(path, block_size=4, enable_prefix_caching=True)
    first = llm.generate({"prompt_token_ids": prompt}, greedy(2), use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, greedy(2), use_tqdm=False)[0]
    assert first.prompt_logprobs is None and again.num_cached_tokens == 20
    out = llm.generate({"prompt_token_ids": prompt}, greedy(2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, prompt, ref, 2)
    tight = make_llm(path, block_size=2, num_gpu_blocks_override=14,
                     max_num_batched_tokens=6, enable_prefix_caching=True)
    prompts = [prompt, *random_prompts(2, [17, 19], seed=9)]
    engine = tight.llm_engine
    ids = [engine.add_request(None, p, greedy(5, prompt_logprobs=1)) for p in prompts]
    final, preempted = {}, 0
    while engine.has_unfinished_requests():
        outs, stats = engine.step_with_stats()
        preempted += len(stats.preempted_req_ids)
        final.update({o.request_id: o for o in outs if o.finished})
    assert preempted > 0
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    for p, rid in zip(prompts, ids):
        check(final[rid].prompt_logprobs, p, oracle(path, p), 1)


def test_parallel_sampling_and_output_kinds(tiny_model_dir):
    """n > 1: the group's output carries the prompt's logprobs (computed once, by its
    prefill); DELTA hands them out once, in the first output; FINAL_ONLY in the last."""
    path = tiny_model_dir("mistral")
    prompt = random_prompts(1, [10], seed=4)[0]
    ref = oracle(path, prompt)
    llm = make_llm(path, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True,
                            prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, prompt, ref, 2)
    engine = llm.llm_engine
    for kind, n in ((RequestOutputKind.DELTA, 1), (RequestOutputKind.DELTA, 2),
                    (RequestOutputKind.FINAL_ONLY, 1)):
        rid = engine.add_request(None, prompt, SamplingParams(
            n=n, temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1,
            output_kind=kind))
        seen = []
        while engine.has_unfinished_requests():
            seen += [o for o in engine.step() if o.request_id == rid]
        with_lp = [o for o in seen if o.prompt_logprobs is not None]
        assert len(with_lp) == 1 and with_lp[0] is seen[0], (kind, n)
        check(with_lp[0].prompt_logprobs, prompt, ref, 1)


def test_bad_prompt_logprobs_are_refused(tiny_model_dir):
    """A ValueError naming the field and its range: below -1, not an int, above the
    engine's max_logprobs (-1 too, unless max_logprobs=-1)."""
    for bad in (-2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    llm = make_llm(tiny_model_dir("llama"), max_logprobs=4)
    for asked in (5, -1):
        with pytest.raises(ValueError, match=f"prompt_logprobs={asked} .*max_logprobs=4"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(1, prompt_logprobs=asked),
                         use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
