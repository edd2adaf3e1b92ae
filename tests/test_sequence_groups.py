"""Parallel sampling (``n > 1``) and beam search in the engine, against oracles.

- Beam search: transformers' ``generate(num_beams=W, do_sample=False)`` on tiny
  random-weight Llama and Qwen2 models in float32 (vLLM's own beam test does
  the same): the same ``W`` best sequences, in order, with the same scores. A
  model whose EOS row is boosted makes beams end early, so finished hypotheses
  and the early-stop heuristic are exercised; tiny pools and ``max_num_seqs``
  force the group through preemption and requeueing.
- Parallel sampling: completion ``i`` of ``SamplingParams(n, seed=s)`` is the
  independent request with ``seed=s + i`` (vLLM's per-child seeds); greedy
  completions equal transformers' greedy continuation; the group holds fewer
  blocks than ``n`` independent requests; every block comes back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_model, save_tiny_model
from test_engine import hf_greedy, make_llm, random_prompts

from minivllm import BeamSearchParams, SamplingParams
from minivllm.sampling_params import RequestOutputKind

EOS = 257


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose EOS logit is raised, so beams end at different lengths."""
    path = save_tiny_model(tmp_path_factory.mktemp("eos_llama"), "llama", seed=3)
    model = hf_model(path)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4.0
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_beams(path, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
             ignore_eos: bool) -> list[tuple[list[int], float]]:
    """transformers' best ``width`` sequences: (generated tokens, normalised score).

    The score is recomputed from the model's log-probabilities of each sequence:
    summed over the generated tokens, over ``len ** length_penalty``.
    """
    model = hf_model(path)
    if ignore_eos:  # EOS is then a token like any other, as in the engine
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, do_sample=False,
            num_return_sequences=width, max_new_tokens=max_tokens, early_stopping=False,
            length_penalty=length_penalty, pad_token_id=EOS,
            eos_token_id=None if ignore_eos else EOS)
        result = []
        for seq in out:
            gen = seq[len(prompt):].tolist()
            if not ignore_eos and EOS in gen:  # padding after the EOS that ended it
                gen = gen[: gen.index(EOS) + 1]
            logprobs = torch.log_softmax(model(torch.tensor([prompt + gen])).logits[0], -1)
            total = sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(gen))
            result.append((gen, total / len(gen) ** length_penalty))
    return result


def check_beams(llm, path, prompts, params: BeamSearchParams) -> None:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        want = hf_beams(path, prompt, params.beam_width, params.max_tokens,
                        params.length_penalty, params.ignore_eos)
        got = [(s.tokens[len(prompt):], s.score) for s in out.sequences]
        assert [g for g, _ in got] == [w for w, _ in want], (prompt, got, want)
        for (_, gs), (_, ws) in zip(got, want):
            assert gs == pytest.approx(ws, abs=1e-4)
        for s in out.sequences:
            assert s.tokens[: len(prompt)] == prompt
            assert s.finish_reason == ("stop" if s.tokens[-1] == EOS and not params.ignore_eos
                                       else "length")
    assert llm.llm_engine.scheduler.num_free_blocks == llm.llm_engine.cache_config.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_matches_transformers(tiny_model_dir, arch, width):
    path = tiny_model_dir(arch)
    prompts = random_prompts(2, [7, 19], seed=width)
    llm = make_llm(path, block_size=4)
    check_beams(llm, path, prompts, BeamSearchParams(beam_width=width, max_tokens=9,
                                                      ignore_eos=True))


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_beam_search_with_eos_matches_transformers(eos_model_dir, length_penalty):
    prompts = random_prompts(3, [5, 12, 9], seed=11)
    llm = make_llm(eos_model_dir, block_size=3)
    check_beams(llm, eos_model_dir, prompts,
                BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=length_penalty))


@pytest.mark.parametrize("width,ignore_eos,overrides", [
    (3, True, {"num_gpu_blocks_override": 30, "max_num_seqs": 9}),  # preemption
    (3, False, {"max_num_seqs": 4}),  # no room to fork: a group recomputes, or steps aside
    (2, True, {"max_num_seqs": 3}),
    (3, False, {"max_num_batched_tokens": 5}),  # chunked prefill of every recomputation
])
def test_beam_search_under_pressure_matches_transformers(eos_model_dir, width, ignore_eos,
                                                         overrides):
    prompts = random_prompts(3, [11, 6, 9], seed=5)
    llm = make_llm(eos_model_dir, block_size=2, **overrides)
    check_beams(llm, eos_model_dir, prompts,
                BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=ignore_eos))


def test_beam_search_refuses_bad_input(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), block_size=4, max_num_seqs=4,
                   num_gpu_blocks_override=40)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="beam_width=5 must be <= max_num_seqs=4"):
        llm.beam_search([{"prompt_token_ids": [1, 2, 3]}],
                        BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="beam_width=4 sequences"):  # 4 x 64 tokens > 40 blocks
        llm.beam_search([{"prompt_token_ids": [1] * 30}],
                        BeamSearchParams(beam_width=4, max_tokens=34))
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks


@pytest.mark.parametrize("overrides", [
    {"backend": {"linear": "ref"}},  # the stages simulated in one process
    {"backend": {"linear": "ref"}, "max_num_batched_tokens": 6, "max_num_seqs": 5,
     "num_gpu_blocks_override": 30},  # and a group split over micro-batches, preempted
    {"backend": {"linear": "fast"}},  # one process per stage
])
def test_beam_search_with_pipeline_parallelism_matches_transformers(eos_model_dir,
                                                                     overrides):
    """With two pipeline stages (micro-batches in flight), a group ranks when its last
    beam's candidates come back: the beams are transformers'."""
    prompts = random_prompts(3, [11, 6, 9], seed=5)
    llm = make_llm(eos_model_dir, block_size=2, pipeline_parallel_size=2, **overrides)
    try:
        check_beams(llm, eos_model_dir, prompts,
                    BeamSearchParams(beam_width=3, max_tokens=7, ignore_eos=False))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("choices,width", [
    (["abc", "abcd", "abd", "xyz", "b"], 3),
    (["hello", "help", "hel", "yellow", "he"], 4),
])
def test_beam_search_with_structured_outputs_matches_transformers(eos_model_dir, choices,
                                                                   width):
    """``BeamSearchParams(structured_outputs=...)`` (vLLM's field): every beam ranks only
    the tokens its own grammar allows. The oracle is transformers' beam search with a
    logits processor over the same choices, written here (a prefix of a choice may go
    on; EOS once the text is a whole choice). As in vLLM, where the grammar masks the
    logits before the log-probabilities are taken, the candidates' log-probabilities
    are renormalized over the allowed tokens (transformers' own
    ``prefix_allowed_tokens_fn`` masks after the log-softmax, and ranks differently)."""
    from conftest import byte_tokenizer
    from transformers import LogitsProcessor, LogitsProcessorList

    from minivllm import StructuredOutputsParams

    tok = byte_tokenizer()
    encoded = [tok.encode(c, add_special_tokens=False) for c in choices]
    prompt = random_prompts(1, [9], seed=width)[0]

    def allowed(gen: list[int]) -> list[int]:
        if gen and gen[-1] == EOS:
            return [EOS]  # a finished beam's padding
        nxt = {e[len(gen)] for e in encoded if e[: len(gen)] == gen and len(e) > len(gen)}
        return sorted(nxt | ({EOS} if gen in encoded else set()))

    class Choices(LogitsProcessor):  # mask, then log-softmax again over what is left
        def __call__(self, input_ids, scores):
            mask = torch.full_like(scores, float("-inf"))
            for row, ids in enumerate(input_ids):
                mask[row, allowed(ids[len(prompt):].tolist())] = 0.0
            return torch.log_softmax(scores + mask, dim=-1)

    model = hf_model(eos_model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False,
                             num_return_sequences=width, max_new_tokens=8,
                             early_stopping=False, pad_token_id=EOS, eos_token_id=EOS,
                             logits_processor=LogitsProcessorList([Choices()]))
    want = []
    for seq in out:
        gen = seq[len(prompt):].tolist()
        want.append(gen[: gen.index(EOS) + 1] if EOS in gen else gen)
    llm = make_llm(eos_model_dir, block_size=4)
    params = BeamSearchParams(beam_width=width, max_tokens=8,
                              structured_outputs=StructuredOutputsParams(choice=choices))
    got = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
    assert [s.tokens[len(prompt):] for s in got.sequences] == want
    assert all(tok.decode(s.tokens[len(prompt):-1]) in choices for s in got.sequences)
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    assert not engine.structured.grammars
    with pytest.raises(ValueError, match="ignore_eos"):
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True,
                         structured_outputs=StructuredOutputsParams(choice=choices))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_beam_search_and_n_compose_with_speculative_decoding(tiny_model_dir, method):
    """With speculative decoding on, a beam search equals transformers' (beams rank their
    candidates, they get no drafts) while greedy requests with n = 3 in the same engine
    verify drafts and still give transformers' greedy tokens in every child."""
    path = tiny_model_dir("llama")
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["num_draft_layers"] = 1
    else:
        spec["prompt_lookup_min"] = 1
    llm = make_llm(path, block_size=4, speculative_config=spec)
    prompts = random_prompts(2, [7, 19], seed=3)
    check_beams(llm, path, prompts, BeamSearchParams(beam_width=3, max_tokens=6,
                                                      ignore_eos=True))
    engine, want = llm.llm_engine, hf_greedy(path, prompts, 8)
    ids = [engine.add_request(None, p, SamplingParams(n=3, temperature=0.0, max_tokens=8,
                                                      ignore_eos=True)) for p in prompts]
    final, drafted = {}, 0
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        drafted += stats.num_draft_tokens
        final.update({o.request_id: o for o in outputs if o.finished})
    assert drafted > 0
    for rid, w in zip(ids, want):
        assert [list(c.token_ids) for c in final[rid].outputs] == [w] * 3
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks


# -- parallel sampling ---------------------------------------------------------------


def test_n_greedy_children_equal_transformers(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    prompts = random_prompts(3, [9, 4, 17], seed=2)
    want = hf_greedy(path, prompts, 8)
    llm = make_llm(path, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))
    for out, w in zip(outs, want):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [list(c.token_ids) for c in out.outputs] == [w] * 3


@pytest.mark.parametrize("overrides", [{}, {"num_gpu_blocks_override": 24, "max_num_seqs": 3}])
def test_n_children_are_the_requests_with_seed_plus_index(tiny_model_dir, overrides):
    """Completion i of n with seed s is the lone request with seed s + i (vLLM's rule),
    also when the pool is short (preemption) or max_num_seqs leaves no room to fork."""
    path = tiny_model_dir("llama")
    prompt = {"prompt_token_ids": random_prompts(1, [13], seed=4)[0]}
    llm = make_llm(path, block_size=4, **overrides)
    kw = dict(temperature=1.0, max_tokens=10, ignore_eos=True, logprobs=2)
    group = llm.generate([prompt], SamplingParams(n=4, seed=7, **kw))[0]
    alone = llm.generate([prompt] * 4, [SamplingParams(seed=7 + i, **kw) for i in range(4)])
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1, "children must differ"
    for i, (c, a) in enumerate(zip(group.outputs, alone)):
        assert c.index == i
        assert list(c.token_ids) == list(a.outputs[0].token_ids)
        assert c.finish_reason == "length"
        assert len(c.logprobs) == 10
        assert c.cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks


def _peak_blocks(llm, prompts, params) -> int:
    engine = llm.llm_engine
    for p, sp in zip(prompts, params):
        engine.add_request(None, p, sp)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.cache_config.num_blocks - engine.scheduler.num_free_blocks)
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    return peak


def test_n_children_share_the_prompt_blocks(tiny_model_dir):
    """n=4 on a 40-token prompt (block 8: 5 blocks) holds the prompt once: a peak of
    5 shared + 4 x 2 own blocks, against 4 x 7 for independent requests."""
    path = tiny_model_dir("llama")
    prompt = random_prompts(1, [40], seed=9)[0]
    kw = dict(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1)
    llm = make_llm(path, block_size=8, enable_prefix_caching=False)
    shared = _peak_blocks(llm, [prompt], [SamplingParams(n=4, **kw)])
    alone = _peak_blocks(llm, [prompt] * 4, [SamplingParams(**kw)] * 4)
    assert alone == 4 * 7
    assert shared == 5 + 4 * 2


def test_n_streams_deltas_with_their_index(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), block_size=4)
    engine = llm.llm_engine
    rid = engine.add_request(None, [3, 1, 4, 1, 5], SamplingParams(
        n=3, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA))
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid and not finished
            for c in out.outputs:
                tokens[c.index] += c.token_ids
            finished = out.finished
    assert finished
    assert all(len(t) == 5 for t in tokens.values())


def test_n_refuses_bad_input_and_aborts_whole(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), block_size=4, max_num_seqs=4,
                   num_gpu_blocks_override=30)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n=4 sequences"):  # 4 x 8 blocks > 30
        engine.add_request(None, [1] * 20, SamplingParams(n=4, max_tokens=12))
    assert not engine.has_unfinished_requests()
    rid = engine.add_request(None, [1] * 9, SamplingParams(n=4, max_tokens=8, seed=0))
    engine.step()
    engine.step()
    assert engine.cache_config.num_blocks - engine.scheduler.num_free_blocks > 3
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    assert engine.step() == []
    out = llm.generate([{"prompt_token_ids": [2, 7]}], SamplingParams(n=2, max_tokens=3))[0]
    assert len(out.outputs) == 2


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_n_forks_a_quantized_kv_cache_with_its_scales(tiny_model_dir, kv_cache_dtype):
    """Copy-on-write of a quantized cache copies the blocks' scales too: every greedy
    completion equals the lone greedy request on the same quantized cache."""
    path = tiny_model_dir("llama")
    prompt = {"prompt_token_ids": random_prompts(1, [10], seed=6)[0]}  # a partial last block
    llm = make_llm(path, block_size=4, kv_cache_dtype=kv_cache_dtype)
    sp = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    group = llm.generate([prompt], SamplingParams(n=3, **sp), use_tqdm=False)[0]
    assert [list(c.token_ids) for c in group.outputs] == [list(alone.token_ids)] * 3
