"""End to end: ``LLM.generate`` against transformers' ``generate`` (the oracle).

Runs under the selected backend (``pytest --backend=ref|fast``). Tiny
random-weight models cover Llama, Qwen2, Qwen3 and Mistral with GQA, tied and
untied embeddings and head dims 16, 24 and 40; engine settings cover block
sizes 1..32, chunked prefill (tiny token budgets) and KV pools so small that
requests are preempted and recomputed.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import hf_model

from minivllm import LLM, SamplingParams, backend


def _interpreted_kernels() -> bool:
    """True when attention runs in Triton's CPU interpreter (slow: keep cases small).

    Under ``fast`` a CPU runs the C++ ops; only ``minivllm.fast.triton`` interprets.
    """
    name = backend.get("attention").__name__
    return name.startswith("minivllm.fast.triton") and not torch.cuda.is_available()


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time.

    A plain argmax loop re-running the whole sequence each step (no cache at
    all, so nothing is shared with the engine's paged cache); ``generate`` with
    ``min_new_tokens`` would mask EOS, which ``ignore_eos`` does not.
    """
    model = hf_model(path)
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(max_new_tokens):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(p):])
    return outs


def random_prompts(n: int, lengths: list[int], vocab: int = 256, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def pool_tokens(kw: dict) -> int:
    """Tokens one request may have in the pool ``kw`` (engine arguments) sizes; large if
    the pool is not fixed by ``num_gpu_blocks_override``."""
    blocks = kw.get("num_gpu_blocks_override")
    if blocks is None:
        return 1 << 30
    spec = kw.get("speculative_config") or {}
    return blocks * kw.get("block_size", 16) - spec.get("num_speculative_tokens", 0)


def make_llm(path, **kw) -> LLM:
    """An LLM on the CPU in float32; max_model_len 256, or what a small pool holds.

    A test that forces preemption with a small ``num_gpu_blocks_override``
    gets the longest ``max_model_len`` that pool holds (minus a draft model's
    lookahead): the engine refuses at start a pool too small for one request
    of ``max_model_len`` (engine.config.check_kv_pool_fits).
    """
    kw.setdefault("max_model_len", min(256, pool_tokens(kw)))
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLM(str(path), **kw)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# (arch, block_size, engine overrides): chunked prefill comes from small
# max_num_batched_tokens, preemption from tiny num_gpu_blocks_override.
CASES = [
    ("llama", 16, {}),
    ("llama", 1, {"max_num_batched_tokens": 7}),
    ("qwen2", 3, {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 16}),
    ("qwen3", 32, {"max_num_batched_tokens": 9}),
    ("mistral", 8, {"num_gpu_blocks_override": 7}),
    ("llama_tied", 5, {"max_num_seqs": 2}),
]


@pytest.mark.parametrize("arch,block_size,overrides", CASES)
def test_greedy_matches_transformers(tiny_model_dir, arch, block_size, overrides):
    interp = _interpreted_kernels()
    n_prompts, new_tokens = (3, 5) if interp else (5, 12)
    lengths = [1, 17, 8, 33, 16] if not interp else [1, 17, 9]
    path = tiny_model_dir(arch)
    prompts = random_prompts(n_prompts, lengths, seed=block_size)
    expected = hf_greedy(path, prompts, new_tokens)
    llm = make_llm(path, block_size=block_size, **overrides)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    sched = llm.llm_engine.scheduler
    assert sched.num_free_blocks == llm.llm_engine.cache_config.num_blocks, "KV blocks leaked"
    llm.shutdown()


def test_tiny_pool_preempts_and_still_matches(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = random_prompts(4, [6, 7, 8, 5], seed=3)
    new_tokens = 8 if _interpreted_kernels() else 12
    expected = hf_greedy(path, prompts, new_tokens)
    # All four are admitted (2 blocks of 4 each), then grow to 4-5 blocks each:
    # a pool of 10 cannot hold them, so the newest ones are preempted.
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=10)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, greedy(new_tokens)) for p in prompts]
    preempted, finished = 0, {}
    while engine.has_unfinished_requests():
        before = {r.request_id: r.num_preemptions for r in engine.scheduler.requests.values()}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        preempted += sum(r.num_preemptions - before.get(r.request_id, 0)
                         for r in engine.scheduler.requests.values())
    assert [finished[i] for i in ids] == expected
    assert preempted > 0
    assert engine.scheduler.num_free_blocks == 10


def test_prefix_caching_on_and_off_agree(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(k)] for k in (3, 9, 1)]
    new_tokens = 4 if _interpreted_kernels() else 8
    results = {}
    for caching in (True, False):
        llm = make_llm(path, block_size=8, enable_prefix_caching=caching)
        first = llm.generate({"prompt_token_ids": prompts[0]}, greedy(new_tokens),
                             use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                            greedy(new_tokens), use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        cached = [o.num_cached_tokens for o in rest]
        if caching:
            assert all(c >= 32 for c in cached), cached  # 4 full shared blocks of 8
        else:
            assert cached == [0, 0]
    assert results[True] == results[False]
    assert results[True] == hf_greedy(path, prompts, new_tokens)


def test_seeded_sampling_is_independent_of_batch(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = make_llm(path)
    prompt = {"prompt_token_ids": random_prompts(1, [11], seed=1)[0]}
    others = [{"prompt_token_ids": p} for p in random_prompts(3, [5, 30, 2], seed=2)]
    n = 6 if _interpreted_kernels() else 16
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=n, ignore_eos=True)
    alone = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    mixed_params = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True)] * 2 + [sp] + [
        SamplingParams(temperature=1.0, seed=99, max_tokens=3, ignore_eos=True)]
    batch = llm.generate(others[:2] + [prompt] + others[2:], mixed_params, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=n,
                                    ignore_eos=True)
    other = llm.generate(prompt, different_seed, use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone  # 256-way choices over 16 tokens: equal only by a miracle


def test_stop_token_ids_and_stop_strings(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = make_llm(path)
    prompt = {"prompt_token_ids": random_prompts(1, [9], seed=5)[0]}
    full = llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0]
    ids = full.token_ids
    # Stop at the first occurrence of the 6th token's id: it is included in token_ids.
    stop_id = ids[5]
    out = llm.generate(prompt, greedy(24, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    cut = ids.index(stop_id) + 1
    assert out.outputs[0].token_ids == ids[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # Stop string: a piece of the full text; the output ends right before it.
    text = full.text
    assert len(text) >= 6
    stop = text[3:6]
    out = llm.generate(prompt, greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_logprobs_match_transformers(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    prompt = random_prompts(1, [13], seed=11)[0]
    llm = make_llm(path)
    n = 4
    out = llm.generate({"prompt_token_ids": prompt}, greedy(n, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    model = hf_model(path)
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(seq).logits[0].float(), -1)[len(prompt) - 1 : -1]
    assert len(out.logprobs) == n
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in lp and lp[tok].rank == 1
        top = torch.topk(ref[step], 3)
        assert set(lp) == set(top.indices.tolist()) | {tok}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[t].logprob == pytest.approx(v, abs=1e-4)


def test_logprobs_minus_one_is_the_whole_vocabulary_under_max_logprobs(tiny_model_dir):
    """vLLM's rules: ``logprobs=-1`` is every token's log-probability, allowed once
    ``max_logprobs=-1`` lifts the engine's cap (default 20, which refuses 21 and -1)."""
    path = tiny_model_dir("qwen2")
    prompt = random_prompts(1, [9], seed=5)[0]
    capped = make_llm(path)
    for asked in (21, -1):
        with pytest.raises(ValueError, match=f"logprobs={asked} .*max_logprobs=20"):
            capped.generate({"prompt_token_ids": prompt}, greedy(2, logprobs=asked),
                            use_tqdm=False)
    assert capped.llm_engine.scheduler.num_free_blocks == \
        capped.llm_engine.cache_config.num_blocks
    five = make_llm(path, max_logprobs=5)
    five.generate({"prompt_token_ids": prompt}, greedy(2, logprobs=5), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs=5"):
        five.generate({"prompt_token_ids": prompt}, greedy(2, logprobs=6), use_tqdm=False)
    llm = make_llm(path, max_logprobs=-1)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(3, logprobs=-1),
                       use_tqdm=False)[0].outputs[0]
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(path)(seq).logits[0].float(), -1)[len(prompt) - 1:-1]
    vocab = ref.shape[-1]
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(lp) == vocab and lp[tok].rank == 1
        got = torch.tensor([lp[t].logprob for t in range(vocab)])
        torch.testing.assert_close(got, ref[step], atol=1e-4, rtol=0)


def test_bad_input_gets_clear_errors_and_harms_no_one(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = make_llm(path, max_model_len=64, num_gpu_blocks_override=32, block_size=4)
    engine = llm.llm_engine
    good = random_prompts(2, [10, 6], seed=9)
    expected = hf_greedy(path, good, 5)
    # Queue good requests, then throw bad ones at the running engine.
    ids = [engine.add_request(None, p, greedy(5)) for p in good]
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(None, [1] * 70, greedy(5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, [], greedy(5))
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        engine.add_request(None, [1, 2, 999], greedy(5))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == expected
    assert engine.scheduler.num_free_blocks == 32

    # Through LLM.generate: the whole call is refused before anything is queued.
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([{"prompt_token_ids": good[0]}, {"prompt_token_ids": []}], greedy(3),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 60}, greedy(10), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == 32
    again = llm.generate([{"prompt_token_ids": p} for p in good], greedy(5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected


def test_generate_accepts_vllm_prompt_forms_and_chat(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = make_llm(path)
    tok = llm.get_tokenizer()
    text_out = llm.generate("hello", greedy(3), use_tqdm=False)
    ids_out = llm.generate({"prompt_token_ids": tok.encode("hello")}, greedy(3), use_tqdm=False)
    assert text_out[0].outputs[0].token_ids == ids_out[0].outputs[0].token_ids
    assert text_out[0].prompt == "hello"
    many = llm.generate(["a", "bc"], [greedy(2), greedy(3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in many] == [2, 3]
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)
    expected = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert chat[0].prompt == expected
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [greedy(2)], use_tqdm=False)


def test_profiler_writes_a_trace_with_engine_stages(tiny_model_dir, tmp_path, capsys):
    import minivllm

    llm = make_llm(tiny_model_dir("llama"))
    trace = tmp_path / "trace.json"
    with minivllm.Profiler(str(trace)):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(2), use_tqdm=False)
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    for stage in ("schedule", "prepare_inputs", "forward", "sample", "detokenize", "layer.0"):
        assert stage in names
    assert "forward" in capsys.readouterr().out
    llm.start_profile(str(tmp_path / "t2.json"))
    llm.generate({"prompt_token_ids": [4, 5]}, greedy(2), use_tqdm=False)
    llm.stop_profile()
    assert (tmp_path / "t2.json").exists()


def test_smollm2_greedy_matches_transformers(smollm2_dir):
    """The real default model: several prompts, 32 greedy tokens each, one batch."""
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_model_len=512)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(smollm2_dir, prompts, 32)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text


@pytest.mark.cuda
def test_fast_matches_ref_on_cuda_with_cuda_graphs(tiny_model_dir):
    """A larger random Qwen3-style model on the GPU: Triton kernels + CUDA graphs == ref."""
    path = tiny_model_dir("qwen3", hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=128, intermediate_size=1024, num_hidden_layers=4,
                          max_position_embeddings=2048)
    prompts = random_prompts(12, [1, 17, 64, 130, 33, 5], seed=21)
    outs = {}
    for spec in ("ref", "fast"):
        llm = LLM(str(path), backend=spec, dtype="float32", device="cuda", max_model_len=1024,
                  max_num_seqs=16, max_num_batched_tokens=128, num_gpu_blocks_override=512)
        if spec == "fast":
            runner = llm.llm_engine.executor.worker.model_runner
            assert runner.fast_paths == ("cuda_graphs",), runner.describe()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24),
                           use_tqdm=False)
        outs[spec] = [o.outputs[0].token_ids for o in res]
    assert outs["fast"] == outs["ref"]
    assert outs["ref"][:4] == hf_greedy(path, prompts[:4], 24)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_model_dir):
    """vLLM's left truncation: the output is that of the last ``k`` tokens as the prompt
    (the oracle: the same engine given only those), and -1 keeps ``max_model_len``."""
    path = tiny_model_dir("llama")
    llm = make_llm(path, max_model_len=64)
    prompt = random_prompts(1, [30], seed=3)[0]
    cut = llm.generate({"prompt_token_ids": prompt}, greedy(5, truncate_prompt_tokens=7),
                       use_tqdm=False)[0]
    whole = llm.generate({"prompt_token_ids": prompt[-7:]}, greedy(5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == whole.outputs[0].token_ids
    long = random_prompts(1, [70], seed=4)[0]
    with pytest.raises(ValueError, match="max_model_len"):  # 64 kept + 5 new > 64
        llm.generate({"prompt_token_ids": long}, greedy(5, truncate_prompt_tokens=-1),
                     use_tqdm=False)
    out = llm.generate({"prompt_token_ids": long}, greedy(5, truncate_prompt_tokens=59),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-59:] and len(out.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        greedy(5, truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be at most"):
        llm.generate({"prompt_token_ids": prompt}, greedy(5, truncate_prompt_tokens=65),
                     use_tqdm=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
