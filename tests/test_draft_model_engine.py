"""Draft-model speculation in the engine: it changes the speed, never the tokens.

``LLM(..., speculative_config={"method": "draft_model", "num_speculative_tokens": k,
"num_draft_layers": L})`` on tiny random-weight models (3 layers):

- greedy with speculation == greedy without == transformers' greedy loop, for
  ``k`` of 1, 3 and 5, self-speculation with ``L`` of 1 and 3 (all layers),
  with chunked prefill and a KV pool small enough to preempt, and a separate
  draft model (``model=path``) with its own KV cache;
- with every layer as the draft, greedy accepts every draft (the draft writes
  the target's own KV cache, so a wrong write would show as a rejection); the
  same for the target's weights as a *separate* draft across preemptions (its
  own cache must be recomputed on the new blocks);
- seeded sampling is reproducible: the same seeded requests give the same
  tokens twice, and alone as in a batch. Sampling with all layers as the draft
  (``q`` = ``p``) accepts nearly every draft.

Run: ``CI=true pytest -q tests/test_draft_model_engine.py --backend=ref`` (and ``--backend=fast``).
"""

from __future__ import annotations

import pytest
from test_engine import greedy, hf_greedy, make_llm, random_prompts

from minivllm import SamplingParams


def spec(k: int, layers: int | None = None, model: str | None = None) -> dict:
    config = {"method": "draft_model", "num_speculative_tokens": k}
    if layers is not None:
        config["num_draft_layers"] = layers
    if model is not None:
        config["model"] = model
    return config


def generate_with_stats(llm, prompts, params, counts: dict | None = None):
    """Token ids per prompt and the summed verification counts of every step
    (and, into ``counts``, the preemptions)."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    finished, drafted, accepted = {}, 0, 0
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        if counts is not None:
            counts["preempted"] = counts.get("preempted", 0) + len(stats.preempted_req_ids)
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks, "KV blocks leaked"
    return [finished[i] for i in ids], drafted, accepted


# (k, L, engine overrides): chunked prefill from a small token budget, preemption
# from a tiny pool (blocks of 4: 10 blocks cannot hold four growing requests).
CASES = [
    (1, 1, {}),
    (3, 1, {"max_num_batched_tokens": 9}),
    (5, 2, {"block_size": 4, "num_gpu_blocks_override": 14}),
    (3, 3, {}),
    (5, None, {"block_size": 4}),
]


@pytest.mark.parametrize("k,layers,overrides", CASES)
def test_greedy_with_self_speculation_matches_transformers(tiny_model_dir, k, layers, overrides):
    path = tiny_model_dir("llama", num_hidden_layers=3)
    prompts = random_prompts(4, [5, 17, 8, 1], seed=k)
    new_tokens = 14
    expected = hf_greedy(path, prompts, new_tokens)
    plain = make_llm(path, **overrides)
    without = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens),
                             use_tqdm=False)
    plain.shutdown()
    assert [o.outputs[0].token_ids for o in without] == expected
    llm = make_llm(path, speculative_config=spec(k, layers), **overrides)
    got, drafted, accepted = generate_with_stats(llm, prompts, greedy(new_tokens))
    llm.shutdown()
    assert got == expected
    assert drafted > 0, "no draft was verified"
    if layers in (3, None):  # the draft is the whole target: every greedy draft is right
        assert accepted == drafted


@pytest.mark.parametrize("arch", ["qwen2", "llama_tied"])
def test_other_architectures(tiny_model_dir, arch):
    path = tiny_model_dir(arch, num_hidden_layers=3)
    prompts = random_prompts(3, [9, 2, 21], seed=5)
    expected = hf_greedy(path, prompts, 10)
    llm = make_llm(path, block_size=8, speculative_config=spec(3, 2))
    got, drafted, _ = generate_with_stats(llm, prompts, greedy(10))
    llm.shutdown()
    assert got == expected and drafted > 0


def test_separate_draft_model(tiny_model_dir):
    target = tiny_model_dir("llama", num_hidden_layers=2)
    draft = tiny_model_dir("llama", seed=1, num_hidden_layers=2)
    prompts = random_prompts(3, [6, 13, 3], seed=11)
    expected = hf_greedy(target, prompts, 12)
    llm = make_llm(target, block_size=4, speculative_config=spec(3, model=str(draft)))
    got, drafted, _ = generate_with_stats(llm, prompts, greedy(12))
    llm.shutdown()
    assert got == expected and drafted > 0


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    path = tiny_model_dir("llama", num_hidden_layers=3)
    prompts = random_prompts(3, [7, 4, 12], seed=2)
    params = [SamplingParams(temperature=0.8, top_k=50, seed=100 + i, max_tokens=12,
                             ignore_eos=True) for i in range(3)]
    llm = make_llm(path, speculative_config=spec(3, 2))

    def run(ps, prs):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], prs, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    first = run(prompts, params)
    assert run(prompts, params) == first
    assert run(prompts[1:2], params[1:2]) == first[1:2]
    assert all(len(t) == 12 for t in first)
    llm.shutdown()


def test_sampling_with_every_layer_accepts_nearly_everything(tiny_model_dir):
    """All layers as the draft: q equals p (up to rounding), so u * q(x) < p(x) nearly always."""
    path = tiny_model_dir("llama", num_hidden_layers=2)
    prompts = random_prompts(3, [5, 9, 3], seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)
    llm = make_llm(path, speculative_config=spec(3))
    _, drafted, accepted = generate_with_stats(llm, prompts, params)
    llm.shutdown()
    assert drafted > 20 and accepted >= 0.95 * drafted


def test_separate_draft_survives_preemption(tiny_model_dir):
    """The target's own weights as a separate draft: every greedy draft is right, also
    after a preemption moved a request to new blocks (its draft cache must be redone)."""
    path = tiny_model_dir("llama", num_hidden_layers=2)
    prompts = random_prompts(4, [6, 7, 8, 5], seed=3)
    expected = hf_greedy(path, prompts, 12)
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=14,
                   speculative_config=spec(3, model=str(path)))
    counts = {}
    got, drafted, accepted = generate_with_stats(llm, prompts, greedy(12), counts)
    llm.shutdown()
    assert got == expected
    assert counts.get("preempted", 0) > 0, "the pool was meant to force a preemption"
    assert drafted > 0 and accepted == drafted


def test_draft_model_with_tensor_parallelism(tiny_model_dir):
    """A draft model runs beside the target's layers on every tensor-parallel rank: with
    the ref's simulated ranks (one process) and with one process per rank (the ranks
    sample alike, so they run the draft's forward and its all-reduces together), the
    greedy tokens are transformers' and drafts were verified. Pipeline stages are
    refused before anything is loaded (speculation needs one stage)."""
    from minivllm import LLM, backend
    from minivllm.executor.ranks import simulates_all_ranks

    path = str(tiny_model_dir("llama", num_hidden_layers=3))
    kernels_ref = {n: "ref" for n, k in backend.COMPONENTS.items() if k == "kernel"}
    for linear in ("ref", "fast"):
        spec_ = {**kernels_ref, "linear": linear}
        kw = dict(backend=spec_, tensor_parallel_size=2, dtype="float32", device="cpu",
                  max_model_len=128, speculative_config=spec(2, layers=1))
        llm = LLM(path, **kw)
        try:
            prompts = random_prompts(2, [5, 9], seed=3)
            got, drafted, _ = generate_with_stats(llm, prompts, greedy(6))
            assert got == hf_greedy(path, prompts, 6), simulates_all_ranks(spec_)
            assert drafted > 0
        finally:
            llm.shutdown()
    with pytest.raises(ValueError, match="speculative_config needs pipeline_parallel_size=1"):
        LLM(path, pipeline_parallel_size=2, dtype="float32", device="cpu", max_model_len=128,
            speculative_config=spec(2, layers=1))
