"""The engine with a quantized KV cache (``kv_cache_dtype``), end to end.

The oracle is transformers' own model with its attention's keys (after RoPE)
and values passed through the round trip written here from the formula of
``minivllm/kv_quant.py`` (per token and KV head: ``s = max|x| / QMAX``, codes
``round(x / s)``, ``x' = codes * s``): the quantized engine must make the same
greedy choices and the same logprobs. The only differences left are float
order: K/V computed in another order can differ in their last bits, and a row
value within that of a rounding boundary then takes the neighbouring code, one
step (``s``) away; the logprob tolerance allows for a few such steps. Chunked
prefill, preemption, prefix caching and the C++ layer stack (bit for bit the
model's own forward) all run with a quantized cache, and the pool holds as
many more tokens as the bytes say.
"""

from __future__ import annotations

import contextlib
import importlib
import random

import pytest
import torch
from conftest import hf_model

from minivllm import LLM, SamplingParams, backend
from minivllm.fast import cpu_ops

QMAX = {"int8": 127.0, "fp8": 448.0, "fp8_e4m3": 448.0}
HF_MODULES = {"llama": "llama", "llama_tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "mistral": "mistral"}


def round_trip(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:  # (..., D)
    """Quantize and dequantize each row of the last dimension, from the formula."""
    x32 = x.float()
    s = x32.abs().amax(dim=-1, keepdim=True) / QMAX[kv_cache_dtype]
    y = torch.where(s > 0, x32 / torch.where(s > 0, s, 1.0), 0.0)
    if kv_cache_dtype == "int8":
        q = torch.round(y).clamp(-127, 127)
    else:
        q = y.to(torch.float8_e4m3fn).float()
    return (q * s).to(x.dtype)


@contextlib.contextmanager
def quantized_kv(arch: str, kv_cache_dtype: str):
    """transformers' eager attention, fed the round trip of its keys and values."""
    module = importlib.import_module(f"transformers.models.{HF_MODULES[arch]}."
                                     f"modeling_{HF_MODULES[arch]}")
    plain = module.eager_attention_forward

    def attention(mod, query, key, value, *args, **kwargs):  # key, value: (B, H_kv, T, D)
        return plain(mod, query, round_trip(key, kv_cache_dtype),
                     round_trip(value, kv_cache_dtype), *args, **kwargs)

    module.eager_attention_forward = attention
    try:
        yield
    finally:
        module.eager_attention_forward = plain


def oracle(path, arch: str, kv_cache_dtype: str, prompts, n: int):
    """Greedy tokens, and the full log-softmax at each step (a forward per token, no cache)."""
    model = hf_model(path)
    tokens, logprobs = [], []
    with torch.no_grad(), quantized_kv(arch, kv_cache_dtype):
        for p in prompts:
            seq, lps = list(p), []
            for _ in range(n):
                lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
                seq.append(int(lp.argmax()))
                lps.append(lp)
            tokens.append(seq[len(p):])
            logprobs.append(lps)
    return tokens, logprobs


def generate(llm: LLM, prompts, n: int, top: int = 5):
    """Greedy tokens and, per step, ``{token: logprob}`` of the ``top`` most likely."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                       logprobs=top), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs, outs


def random_prompts(n, lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _interpreted() -> bool:
    name = backend.get("attention").__name__
    return name.startswith("minivllm.fast.triton") and not torch.cuda.is_available()


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLM(str(path), **kw)


#: Logprob tolerance against the oracle: float order moves logprobs by about 1e-6 here;
#: the round trip itself moves them by 2.6e-2 (int8) and 0.13 (fp8) or more on these
#: models (test_the_tolerance_tells_a_float_cache_from_a_quantized_one).
LOGPROB_TOL = 1e-3

# (arch, model overrides, block_size, engine overrides): chunked prefill from a small
# token budget, preemption from a tiny pool; head_dim 16 (llama), 40 (qwen2, q/k/v bias),
# 24 (qwen3, q/k norm). Untied embeddings: a tied tiny model repeats its last token with
# probability 1, where logprobs are all 0 and show nothing.
CASES = [
    ("llama", {}, 16, {}),
    ("llama", {}, 5, {"max_num_batched_tokens": 7}),
    ("qwen2", {"tie_word_embeddings": False}, 3,
     {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 16,
      "max_model_len": 60}),  # all the pool holds: 20 blocks of 3
    ("qwen3", {}, 5, {"max_num_seqs": 2}),
]


def assert_logprobs_close(got, want):
    """``got[i][step]`` (``{token: logprob}``) against the oracle's full log-softmax."""
    for seq_got, seq_want in zip(got, want):
        for step_got, step_want in zip(seq_got, seq_want):
            for token, logprob in step_got.items():
                assert logprob == pytest.approx(step_want[token].item(), abs=LOGPROB_TOL)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("arch,model_kw,block_size,overrides", CASES)
def test_greedy_and_logprobs_match_transformers_with_a_quantized_cache(
        tiny_model_dir, kv_cache_dtype, arch, model_kw, block_size, overrides):
    n_prompts, new_tokens = (2, 4) if _interpreted() else (4, 10)
    path = tiny_model_dir(arch, **model_kw)
    prompts = random_prompts(n_prompts, [1, 17, 9, 30], seed=block_size)
    want_tokens, want_lps = oracle(path, arch, kv_cache_dtype, prompts, new_tokens)
    llm = make_llm(path, block_size=block_size, kv_cache_dtype=kv_cache_dtype, **overrides)
    tokens, lps, _ = generate(llm, prompts, new_tokens)
    assert tokens == want_tokens
    assert_logprobs_close(lps, want_lps)
    sched = llm.llm_engine.scheduler
    assert sched.num_free_blocks == llm.llm_engine.cache_config.num_blocks, "KV blocks leaked"
    llm.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_tolerance_tells_a_float_cache_from_a_quantized_one(tiny_model_dir, kv_cache_dtype):
    """The float cache's logprobs are more than 10x the tolerance away from the oracle's:
    an engine that ignored kv_cache_dtype (or dequantized nothing) would fail above."""
    path = tiny_model_dir("llama")
    prompts = random_prompts(2, [17, 30], seed=1)
    _, want = oracle(path, "llama", kv_cache_dtype, prompts, 3)
    _, got, _ = generate(make_llm(path), prompts, 3)  # kv_cache_dtype="auto"
    worst = max(abs(lp - w[t].item()) for g_seq, w_seq in zip(got, want)
                for g, w in zip(g_seq, w_seq) for t, lp in g.items())
    assert worst > 10 * LOGPROB_TOL


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_prefix_caching_on_and_off_agree(tiny_model_dir, kv_cache_dtype):
    """A cached block's codes and scales serve a later request as computed ones would."""
    path = tiny_model_dir("qwen3")
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(k)] for k in (3, 9, 1)]
    n = 4 if _interpreted() else 8
    results = {}
    for caching in (True, False):
        llm = make_llm(path, block_size=8, enable_prefix_caching=caching,
                       kv_cache_dtype=kv_cache_dtype)
        first = generate(llm, prompts[:1], n)
        rest = generate(llm, prompts[1:], n)
        results[caching] = first[0] + rest[0]
        cached = [o.num_cached_tokens for o in rest[2]]
        assert all(c >= 32 for c in cached) if caching else cached == [0, 0]
    assert results[True] == results[False]
    assert results[True] == oracle(path, "qwen3", kv_cache_dtype, prompts, n)[0]


def test_the_pool_holds_as_many_more_tokens_as_the_bytes_say(tiny_model_dir):
    """Worker.bytes_per_block counts the codes and the scales: the pool is sized from it,
    and the tensors allocated are exactly that many bytes."""
    path = tiny_model_dir("llama", num_hidden_layers=3)  # GQA 4:2, head_dim 16
    layers, kv_heads, head_dim, block_size, budget = 3, 2, 16, 16, 1 << 20
    blocks = {}
    for kv_cache_dtype, row_bytes in (("auto", 4 * head_dim), ("int8", head_dim + 4),
                                      ("fp8", head_dim + 4)):
        llm = make_llm(path, kv_cache_memory=budget, block_size=block_size,
                       kv_cache_dtype=kv_cache_dtype)
        block_bytes = 2 * layers * block_size * kv_heads * row_bytes
        blocks[kv_cache_dtype] = llm.llm_engine.cache_config.num_blocks
        assert blocks[kv_cache_dtype] == budget // block_bytes
        worker = llm.llm_engine.executor.worker
        assert worker.memory_bytes()["kv_cache"] == blocks[kv_cache_dtype] * block_bytes
        assert len(worker.kv_caches[0]) == (2 if kv_cache_dtype == "auto" else 4)
    assert blocks["int8"] == blocks["fp8"] > 3 * blocks["auto"]  # 64 / 20 bytes a row: 3.2x


@pytest.mark.parametrize("bad", ["fp16", "FP8", "int4", "fp8_e5m2"])
def test_a_bad_kv_cache_dtype_is_refused_before_loading(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("no/such/model", kv_cache_dtype=bad)


needs_cpp = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops did not build")


@needs_cpp
@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    ("float32", "int8"), ("float32", "fp8"), ("bfloat16", "int8"), ("bfloat16", "fp8"),
])
def test_cpp_layer_stack_gives_the_models_own_bits_with_a_quantized_cache(
        tiny_model_dir, monkeypatch, dtype, kv_cache_dtype):
    """enforce_eager (the model's forward, through the fast kernel twins) against the C++
    layer stack: the same tokens and logprobs, bit for bit, and the stack ran."""
    from minivllm.fast.model_runner import LayerStack

    path = str(tiny_model_dir("llama", num_hidden_layers=3))
    kw = dict(backend="fast", dtype=dtype, device="cpu", max_num_batched_tokens=32,
              max_num_seqs=4, block_size=4, kv_cache_dtype=kv_cache_dtype)
    prompts = random_prompts(5, [3, 11, 25, 40, 7], seed=7)
    eager = LLM(path, enforce_eager=True, **kw)
    expect = generate(eager, prompts, 10)[:2]
    fast = LLM(path, **kw)
    assert fast.llm_engine.executor.worker.model_runner.fast_paths == ("cpu_layer_stack",)
    rows: list[int] = []
    run = LayerStack.run
    monkeypatch.setattr(LayerStack, "run",
                        lambda self, mi, **kw: rows.append(mi.input_ids.shape[0]) or run(self, mi, **kw))
    assert generate(fast, prompts, 10)[:2] == expect
    assert rows
