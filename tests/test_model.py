"""The model over a paged KV cache computes what transformers computes.

Oracle: transformers' own ``AutoModelForCausalLM`` (eager attention) run on each
full sequence at once, no cache. Our model instead sees one flattened batch
of many sequences per step -- prefills, chunks of prefills and decodes mixed --
with K/V written to randomly scattered cache blocks, and must reproduce every
row of logits. Runs under the backend being tested (``--backend=ref|fast``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, PagedRunner, hf_model

from minivllm.model import load_model
from minivllm.model.architectures import get_model_class

ATOL = RTOL = 1e-4  # fp32 end to end

# Every block size on the GQA Llama; one (different) block size per other variant.
CASES = [("llama", bs) for bs in (1, 3, 16, 32)] + [
    ("llama_tied", 32), ("qwen2", 3), ("qwen3", 16), ("mistral", 1),
]


def _sequences(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY_VOCAB, (L,), generator=g).tolist() for L in lengths[:n]]


def _reference_logits(path, seqs: list[list[int]]) -> list[torch.Tensor]:
    ref = hf_model(path)
    with torch.no_grad():
        return [ref(torch.tensor([s])).logits[0] for s in seqs]  # each (L, vocab)


def _check(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("arch,block_size", CASES)
def test_prefill_then_decode_matches_transformers(tiny_model_dir, arch, block_size):
    """Three prompts prefilled in ONE batch, then three batched decode steps."""
    path = tiny_model_dir(arch)
    prompt_lens, num_decode = [7, 1, 12], 3
    seqs = _sequences(3, [n + num_decode for n in prompt_lens], seed=block_size)
    ref = _reference_logits(path, seqs)
    model, _, _ = load_model(path)
    runner = PagedRunner(model, block_size, seed=block_size)

    out = runner.step([(i, s[:n]) for i, (s, n) in enumerate(zip(seqs, prompt_lens))])
    for i, n in enumerate(prompt_lens):
        _check(out[i], ref[i][:n], f"{arch} prefill seq {i}")
    for step in range(num_decode):
        out = runner.step([(i, [s[n + step]]) for i, (s, n) in enumerate(zip(seqs, prompt_lens))])
        for i, n in enumerate(prompt_lens):
            _check(out[i], ref[i][n + step : n + step + 1], f"{arch} decode {step} seq {i}")


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3", "mistral"])
def test_chunked_prefill_mixed_with_decodes(tiny_model_dir, arch):
    """A prompt split over three steps while another sequence decodes in the same batches."""
    path = tiny_model_dir(arch)
    long_seq, short_seq = _sequences(2, [17, 8], seed=7)
    ref_long, ref_short = _reference_logits(path, [long_seq, short_seq])
    model, _, _ = load_model(path)
    runner = PagedRunner(model, block_size=5, seed=3)

    # step 0: prefill the short prompt (5 tokens) and the long one's first chunk
    out = runner.step([("short", short_seq[:5]), ("long", long_seq[:6])])
    _check(out[0], ref_short[:5], "short prefill")
    _check(out[1], ref_long[:6], "long chunk 0")
    # steps 1-2: a decode of the short sequence, batched BEFORE the next chunk
    for step, (a, b) in enumerate([(6, 13), (13, 17)]):
        out = runner.step([("short", [short_seq[5 + step]]), ("long", long_seq[a:b])])
        _check(out[0], ref_short[5 + step : 6 + step], f"short decode {step}")
        _check(out[1], ref_long[a:b], f"long chunk {step + 1}")


def test_bfloat16_close_to_float32(tiny_model_dir):
    """Loading in bf16 casts every parameter and stays near the fp32 logits."""
    path = tiny_model_dir("qwen3")
    seq = _sequences(1, [9], seed=1)[0]
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _, _ = load_model(path, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
        logits[dtype] = PagedRunner(model, 4).step([(0, seq)])[0]
    assert logits[torch.bfloat16].dtype == torch.float32
    scale = logits[torch.float32].abs().max()
    assert (logits[torch.bfloat16] - logits[torch.float32]).abs().max() < 0.1 * scale


def test_tied_embeddings_share_one_matrix(tiny_model_dir):
    model, config, _ = load_model(tiny_model_dir("llama_tied"))
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied, _, _ = load_model(tiny_model_dir("llama"))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_unknown_architecture_lists_supported():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(GPT2Config(architectures=["GPT2LMHeadModel"]))


def test_kv_caches_must_match_layers(tiny_model_dir):
    model, _, _ = load_model(tiny_model_dir("llama"))
    runner = PagedRunner(model, 4)
    runner.kv_caches = runner.kv_caches[:1]
    with pytest.raises(ValueError, match="kv_caches"):
        runner.step([(0, [1, 2, 3])])
