"""The engine's features together on a GPU, against oracles that run on the CPU.

The worker turns logits into tokens on the device the model runs on: seeded
draws, beams, grammar masks, draft verification and proposing all run there,
under the selected backend (``--backend=fast``: Triton kernels and CUDA graphs).
Each test is marked ``cuda`` (``make gpu-check`` runs them) and checks the GPU
engine, in float32, against an oracle computed elsewhere:

- n > 1: child ``i`` of ``SamplingParams(n, seed=s)`` is the lone request with
  ``seed=s + i`` (vLLM's per-child seeds), and greedy children are
  transformers' greedy argmax loop on the CPU;
- speculative decoding (n-gram and a draft model) gives transformers' greedy
  tokens, and drafts were verified;
- beam search with speculation enabled gives transformers' beams;
- LoRA adapters with speculation give PEFT's tokens;
- a regex's greedy answer equals the ref engine's on the CPU, and matches the regex.

Every test also checks that each KV block came back.
"""

from __future__ import annotations

import re

import lora_utils
import pytest
from lora_utils import lora_request, peft_model
from test_engine import greedy, hf_greedy, make_llm, random_prompts
from test_lora_engine import NEW_TOKENS, oracle_tokens
from test_sequence_groups import check_beams

from minivllm import BeamSearchParams, SamplingParams, StructuredOutputsParams

lora_adapters = lora_utils.lora_adapters  # the session fixture (see lora_utils)

DEVICE = "cuda"
pytestmark = pytest.mark.cuda

SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
         "draft_model": {"method": "draft_model", "num_speculative_tokens": 2,
                         "num_draft_layers": 1}}


def gpu_llm(path, **kw):
    """An engine on the GPU with a fixed KV pool: several test processes share one GPU,
    and a pool sized by ``gpu_memory_utilization`` would take what the others need."""
    kw.setdefault("num_gpu_blocks_override", 256)
    return make_llm(path, device=DEVICE, **kw)


def drain(engine) -> tuple[dict, int]:
    """Step ``engine`` until idle: ({request id: final output}, draft tokens proposed)."""
    final, drafted = {}, 0
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        drafted += stats.num_draft_tokens
        final.update({o.request_id: o for o in outputs if o.finished})
    return final, drafted


def all_blocks_back(llm) -> bool:
    engine = llm.llm_engine
    return engine.scheduler.num_free_blocks == engine.cache_config.num_blocks


def test_n_children_are_seeded_requests_on_cuda(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = gpu_llm(path, block_size=4)
    prompt = random_prompts(1, [11], seed=2)[0]
    kw = dict(temperature=0.9, top_p=0.9, top_k=40, max_tokens=9, ignore_eos=True, logprobs=2)
    group = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, seed=5, **kw),
                         use_tqdm=False)[0].outputs
    for i, child in enumerate(group):
        alone = llm.generate({"prompt_token_ids": prompt}, SamplingParams(seed=5 + i, **kw),
                             use_tqdm=False)[0].outputs[0]
        assert child.token_ids == alone.token_ids
        for tok, lp in zip(child.token_ids, child.logprobs):
            assert tok in lp and lp[tok].logprob <= 0.0
    assert len({tuple(c.token_ids) for c in group}) > 1  # the draws differ
    prompts = random_prompts(2, [7, 19], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8, n=2),
                        use_tqdm=False)
    want = hf_greedy(path, prompts, 8)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[w, w] for w in want]
    assert all_blocks_back(llm)


@pytest.mark.parametrize("method", list(SPECS))
def test_speculation_gives_transformers_greedy_tokens_on_cuda(tiny_model_dir, method):
    path = tiny_model_dir("llama")
    llm = gpu_llm(path, block_size=4, speculative_config=SPECS[method])
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], *random_prompts(3, [5, 17, 30], seed=8)]
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, greedy(10)) for p in prompts]
    final, drafted = drain(engine)
    assert [list(final[i].outputs[0].token_ids) for i in ids] == hf_greedy(path, prompts, 10)
    assert drafted > 0
    assert all_blocks_back(llm)


def test_beam_search_with_speculation_enabled_on_cuda(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = gpu_llm(path, block_size=4, speculative_config=SPECS["ngram"])
    check_beams(llm, path, random_prompts(2, [7, 19], seed=3),
                BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))


@pytest.mark.parametrize("method", list(SPECS))
def test_adapters_with_speculation_match_peft_on_cuda(lora_adapters, method):
    base, adapters = lora_adapters("llama")
    names = ["all_r16", None, "qv_r4", "all_r16"]
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], *random_prompts(3, [5, 9, 3], seed=8)]
    oracle = peft_model(base, adapters)
    want = [oracle_tokens(oracle, p, n, NEW_TOKENS) for p, n in zip(prompts, names)]
    llm = gpu_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
                  speculative_config=SPECS[method])
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, greedy(NEW_TOKENS),
                              lora_request=None if n is None else lora_request(adapters, n))
           for p, n in zip(prompts, names)]
    final, drafted = drain(engine)
    assert [list(final[i].outputs[0].token_ids) for i in ids] == want
    assert drafted > 0
    assert all_blocks_back(llm)


def test_regex_answer_equals_the_ref_engine_on_the_cpu(tiny_model_dir):
    path = tiny_model_dir("llama")
    pattern = r"[a-f]{3}-[0-9]{2,4}(x|yz)"
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = ["hello", "The answer is ", "{"]
    texts = {}
    for device, spec in ((DEVICE, None), ("cpu", "ref")):
        llm = (gpu_llm(path, block_size=8) if spec is None else
               make_llm(path, device=device, block_size=8, backend=spec))
        texts[device] = [o.outputs[0].text for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
        assert all_blocks_back(llm)
    assert texts[DEVICE] == texts["cpu"]
    assert all(re.fullmatch(pattern, t) for t in texts[DEVICE]), texts
