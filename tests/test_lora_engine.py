"""Multi-LoRA serving in the engine, against transformers + peft.

The oracle is PEFT's own model (``peft_model``: the adapters loaded through
PEFT's loader) run greedily with a plain argmax loop (no cache), one prompt
and one adapter at a time. The engine gets a mixed batch: prompts under
different adapters and under none, in one ``generate`` call, and must give
each prompt exactly its oracle's tokens (float32). ``max_loras`` below the
number of adapters forces slot reuse (the LRU) and the scheduler's passing
over of requests whose adapter has no slot (the manager refuses a step with
more adapters than slots, so every passing case shows the rule held); a tiny KV pool forces preemption and a
small token budget chunked prefill. Prefix caching with the same prompt under
two adapters must not share their blocks.
"""

from __future__ import annotations

import lora_utils
import pytest
import torch
from lora_utils import lora_request, peft_model
from test_engine import make_llm, random_prompts

from minivllm import SamplingParams
from minivllm.lora.request import LoRARequest

lora_adapters = lora_utils.lora_adapters  # the session fixture (see lora_utils)

NEW_TOKENS = 6


def oracle_tokens(model, prompt: list[int], adapter: str | None, n: int) -> list[int]:
    """PEFT's greedy continuation of ``prompt`` under ``adapter`` (None: the base model)."""
    seq = list(prompt)
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                for _ in range(n):
                    seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        else:
            model.set_adapter(adapter)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def run_mixed(llm, adapters, prompts, names) -> list[list[int]]:
    loras = [None if n is None else lora_request(adapters, n) for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False, lora_request=loras)
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    assert [o.lora_request for o in outs] == loras  # vLLM's RequestOutput.lora_request
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"max_loras": 6}),
    ("qwen2", {"max_loras": 2}),  # fewer slots than adapters: LRU, requests passed over
    ("llama", {"max_loras": 3, "num_gpu_blocks_override": 14, "max_num_batched_tokens": 7,
               "block_size": 2}),  # preemption and chunked prefill
])
def test_mixed_batch_matches_peft(lora_adapters, arch, overrides):
    base, adapters = lora_adapters(arch)
    names = [*adapters, None, "all_r16", None, "qv_r4"]
    prompts = random_prompts(len(names), [5, 9, 3, 12], seed=len(names))
    oracle = peft_model(base, adapters)
    want = [oracle_tokens(oracle, p, n, NEW_TOKENS) for p, n in zip(prompts, names)]
    overrides = dict(overrides)
    llm = make_llm(base, enable_lora=True, max_lora_rank=16,
                   block_size=overrides.pop("block_size", 4), **overrides)
    assert run_mixed(llm, adapters, prompts, names) == want


def test_prefix_cache_keeps_adapters_apart(lora_adapters):
    """One long prompt under two adapters then the base model, prefix caching on: each
    equals its oracle (a shared block would give one adapter's K/V to the other)."""
    base, adapters = lora_adapters("llama")
    prompt = random_prompts(1, [33], seed=3)[0]
    oracle = peft_model(base, adapters)
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
                   enable_prefix_caching=True)
    for name in ("all_r16", "qv_r4", None, "all_r16"):
        got = run_mixed(llm, adapters, [prompt], [name])[0]
        assert got == oracle_tokens(oracle, prompt, name, NEW_TOKENS), name


def test_bad_adapters_are_refused_and_the_engine_serves_on(lora_adapters, tmp_path):
    base, adapters = lora_adapters("llama")
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(ValueError, match="no-such-adapter"):
        llm.generate(prompt, sp, lora_request=LoRARequest("x", 7, str(missing)))
    with pytest.raises(ValueError, match="16"):  # all_r16's rank is above max_lora_rank=8
        llm.generate(prompt, sp, lora_request=lora_request(adapters, "all_r16"))
    with pytest.raises(ValueError, match="lora_int_id 1 is already"):
        llm.generate(prompt * 2, sp, lora_request=[
            lora_request(adapters, "qv_r4"), LoRARequest("other", 1, str(adapters["regex_r1"]))])
    other, _ = lora_adapters("qwen2")  # an adapter made for another model: shapes differ
    wrong = lora_utils.save_peft_adapter(other, tmp_path / "wrong", r=4, lora_alpha=4,
                                         target_modules=["q_proj"])
    with pytest.raises(ValueError, match="another model"):
        llm.generate(prompt, sp, lora_request=LoRARequest("wrong", 9, str(wrong)))
    head = lora_utils.save_peft_adapter(base, tmp_path / "head", r=4, lora_alpha=4,
                                        target_modules=["lm_head"])
    with pytest.raises(ValueError, match="lm_head"):  # a target the engine does not adapt
        llm.generate(prompt, sp, lora_request=LoRARequest("head", 10, str(head)))
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    out = llm.generate(prompt, sp, lora_request=lora_request(adapters, "qv_r4"))
    assert len(out[0].outputs[0].token_ids) == 3
    plain = make_llm(base, block_size=4)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(prompt, sp, lora_request=lora_request(adapters, "qv_r4"))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}])
def test_parallel_ranks_match_peft(lora_adapters, parallel):
    """tp=2 (each rank its shards of A / B: column-parallel B rows, row-parallel A
    columns before the all-reduce) and pp=2 (each stage its layers' slots); real
    processes under --backend=fast, the ref's simulation under --backend=ref."""
    from test_tp_engine import _tp_llm

    base, adapters = lora_adapters("llama")
    names = ["all_r16", None, "patterns_r8", "layer1_r3"]
    prompts = random_prompts(len(names), [7, 4, 10], seed=8)
    oracle = peft_model(base, adapters)
    want = [oracle_tokens(oracle, p, n, NEW_TOKENS) for p, n in zip(prompts, names)]
    tp = parallel.get("tensor_parallel_size", 1)
    kw = {k: v for k, v in parallel.items() if k != "tensor_parallel_size"}
    llm = _tp_llm(base, tp, block_size=4, enable_lora=True, max_loras=2, max_lora_rank=16,
                  **kw)
    try:
        assert run_mixed(llm, adapters, prompts, names) == want
    finally:
        llm.shutdown()


def test_server_serves_adapters_by_model_name(lora_adapters, tmp_path):
    """``serve --enable-lora --lora-modules``: /v1/models lists them, ``model`` picks one
    (through the official client: the offline engine's text under that adapter, whose
    tokens are PEFT's, test_mixed_batch_matches_peft), load/unload at run time."""
    import httpx
    import openai
    from server_utils import ServerProcess

    base, adapters = lora_adapters("llama")
    offline = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=16, block_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def text(name):
        lora = None if name is None else lora_request(adapters, name)
        out = offline.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                               lora_request=lora)
        return out[0].outputs[0].text

    prompt = [72, 101, 108, 108, 111]
    server = ServerProcess(str(base), "--served-model-name", "base", "--enable-lora",
                           "--max-loras", "2", "--max-lora-rank", "16", "--backend", "ref",
                           "--dtype", "float32", "--lora-modules",
                           f"qv={adapters['qv_r4']}", f"all={adapters['all_r16']}",
                           "--allow-runtime-lora-updating")
    try:
        c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                          timeout=60)
        assert [m.id for m in c.models.list().data] == ["base", "qv", "all"]
        for model, name in (("qv", "qv_r4"), ("all", "all_r16"), ("base", None)):
            got = c.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
            assert got.choices[0].text == text(name), model
            assert got.model == model
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="nope", prompt=prompt, max_tokens=2)
        url = server.base_url
        r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "mlp", "lora_path": str(adapters["mlp_rslora_r8"])})
        assert r.status_code == 200, r.text
        bad = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "gone", "lora_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]
        got = c.completions.create(model="mlp", prompt=prompt, max_tokens=NEW_TOKENS,
                                   temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == text("mlp_rslora_r8")
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
        assert r.status_code == 200, r.text
        assert "mlp" not in [m.id for m in c.models.list().data]
    finally:
        server.stop()


def test_smollm2_with_generated_adapters_matches_peft(smollm2_dir, tmp_path):
    """The real model: two generated rank-16 adapters on every linear module of
    SmolLM2 (``bench lora --e2e``'s writer), a mixed batch with the base model,
    against PEFT on the same converted weights (float32)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from minivllm import LLM
    from minivllm.bench._lora_e2e import write_random_adapter

    cfg = AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    adapters = {f"gen{i}": write_random_adapter(tmp_path / f"gen{i}", cfg, rank=16, seed=i)
                for i in range(2)}
    for path in adapters.values():  # B x 30: strong enough to change greedy tokens
        weights = load_file(str(path / "adapter_model.safetensors"))
        save_file({k: v * 30 if "lora_B" in k else v for k, v in weights.items()},
                  str(path / "adapter_model.safetensors"))
    names = ["gen0", None, "gen1", "gen0"]
    prompts = random_prompts(len(names), [7, 12, 5], seed=3)
    oracle = peft_model(smollm2_dir, adapters)
    want = [oracle_tokens(oracle, p, n, 4) for p, n in zip(prompts, names)]
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_model_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    loras = [None if n is None else lora_request(adapters, n) for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False, lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    base = [oracle_tokens(oracle, p, None, 4) for p, n in zip(prompts, names) if n]
    assert base != [w for w, n in zip(want, names) if n], "the adapters change no token"


def test_beam_search_under_an_adapter_matches_the_merged_model(lora_adapters, tmp_path):
    """``LLM.beam_search(..., lora_request=)`` (vLLM's signature): every beam runs under
    the adapter, so the search equals a plain beam search on a model whose weights have
    the adapter merged in (PEFT's ``merge_and_unload``); a batch mixing two adapters
    and the base model gives each prompt its own model's beams."""
    from conftest import byte_tokenizer

    from minivllm import BeamSearchParams

    base, adapters = lora_adapters("llama")
    names = ["all_r16", None, "qv_r4"]
    merged = {}
    for name in ("all_r16", "qv_r4"):
        model = peft_model(base, {name: adapters[name]}).merge_and_unload()
        model.save_pretrained(tmp_path / name, safe_serialization=True)
        byte_tokenizer().save_pretrained(tmp_path / name)
        merged[name] = tmp_path / name
    prompts = random_prompts(3, [5, 8, 3], seed=21)
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    llm = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=16, block_size=4)
    got = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                          lora_request=[None if n is None else lora_request(adapters, n)
                                        for n in names])
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    for prompt, name, out in zip(prompts, names, got):
        oracle = make_llm(base if name is None else merged[name], block_size=4)
        want = oracle.beam_search([{"prompt_token_ids": prompt}], params)[0]
        assert [s.tokens for s in out.sequences] == [s.tokens for s in want.sequences]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            [s.cum_logprob for s in want.sequences], abs=1e-3)
    if names[0] is not None:  # the adapter changes the search (the test can fail)
        base_llm = make_llm(base, block_size=4)
        plain = base_llm.beam_search([{"prompt_token_ids": prompts[0]}], params)[0]
        assert [s.tokens for s in plain.sequences] != [s.tokens for s in got[0].sequences]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_adapters_matches_peft(lora_adapters, method):
    """LoRA and speculative decoding together: drafts (n-gram, or the target's first
    layer without the adapter) are verified by the target under each request's adapter,
    so a mixed batch gives PEFT's greedy tokens, and drafts were verified."""
    base, adapters = lora_adapters("llama")
    names = ["all_r16", None, "qv_r4", "all_r16"]
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], *random_prompts(3, [5, 9, 3], seed=8)]
    oracle = peft_model(base, adapters)
    want = [oracle_tokens(oracle, p, n, NEW_TOKENS) for p, n in zip(prompts, names)]
    spec = {"method": method, "num_speculative_tokens": 2}
    spec.update({"num_draft_layers": 1} if method == "draft_model" else
                {"prompt_lookup_min": 1})
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
                   speculative_config=spec)
    engine, params = llm.llm_engine, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True)
    ids = [engine.add_request(None, p, params,
                              lora_request=None if n is None else lora_request(adapters, n))
           for p, n in zip(prompts, names)]
    final, drafted = {}, 0
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        drafted += stats.num_draft_tokens
        final.update({o.request_id: list(o.outputs[0].token_ids)
                      for o in outputs if o.finished})
    assert [final[i] for i in ids] == want
    assert drafted > 0
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
