"""A KV pool too small for one request of ``max_model_len`` is refused when the engine starts.

The rule (``engine.config.check_kv_pool_fits``): one request alone needs
``ceil((max_model_len + lookahead) / block_size)`` blocks, the scheduler's own
rule at ``add_request``, where ``lookahead`` is a draft model's
``num_speculative_tokens`` (n-gram drafts need none). Each test sits on the
boundary: the pool that is exactly big enough starts and serves a request of
``max_model_len`` tokens, token for token what transformers generates; one
block less is a ``ValueError`` at construction with the numbers and the engine
argument to change. The block's bytes come from the formula (2 x layers x
block_size x KV heads x head_dim x 4 bytes), not from the engine.
"""

from __future__ import annotations

import pytest
from test_engine import greedy, hf_greedy, random_prompts

from minivllm import LLM, SamplingParams

MAX_MODEL_LEN = 60  # not a multiple of the block size: the last block is partial
BLOCK_SIZE = 16
NEEDED = 4  # ceil(60 / 16)


def make(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
               max_model_len=MAX_MODEL_LEN, **kw)


def serves_one_max_length_request(llm: LLM, path) -> None:
    """A prompt of 7 plus 53 new tokens = max_model_len, equal to transformers' greedy."""
    prompt = random_prompts(1, [7], seed=3)[0]
    new_tokens = MAX_MODEL_LEN - len(prompt)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(new_tokens), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(path, [prompt], new_tokens)[0]
    assert out.outputs[0].finish_reason == "length"
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks


def test_num_gpu_blocks_override_one_short_is_refused_with_the_numbers(tiny_model_dir):
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError) as info:
        make(path, num_gpu_blocks_override=NEEDED - 1)
    msg = str(info.value)
    for part in (f"max_model_len={MAX_MODEL_LEN}", f"needs {NEEDED} blocks of {BLOCK_SIZE}",
                 f"has {NEEDED - 1}", f"raise num_gpu_blocks_override to {NEEDED}",
                 f"lower max_model_len to {(NEEDED - 1) * BLOCK_SIZE}"):
        assert part in msg, msg


def test_num_gpu_blocks_override_exactly_enough_serves_a_max_length_request(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = make(path, num_gpu_blocks_override=NEEDED)
    serves_one_max_length_request(llm, path)
    # n > 1 is per request, so its n x blocks are checked when it is added, not at start.
    with pytest.raises(ValueError, match=rf"n=2 sequences .* need {2 * NEEDED} KV blocks"):
        llm.llm_engine.add_request(None, [1] * 7, SamplingParams(n=2, max_tokens=53))
    llm.shutdown()


def test_kv_cache_memory_one_byte_short_names_the_bytes_needed(tiny_model_dir):
    path = tiny_model_dir("llama")  # 2 layers, 2 KV heads, head_dim 16, float32
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    with pytest.raises(ValueError) as info:
        make(path, kv_cache_memory=NEEDED * block_bytes - 1)
    msg = str(info.value)
    for part in (f"needs {NEEDED} blocks", f"({NEEDED * block_bytes} bytes)",
                 f"has {NEEDED - 1}", f"raise kv_cache_memory to {NEEDED * block_bytes} bytes"):
        assert part in msg, msg
    llm = make(path, kv_cache_memory=NEEDED * block_bytes)
    assert llm.llm_engine.cache_config.num_blocks == NEEDED
    serves_one_max_length_request(llm, path)
    llm.shutdown()


@pytest.mark.parametrize("k", [5, 4])
def test_a_draft_models_lookahead_slots_count(tiny_model_dir, k):
    """Self-speculation writes ``k`` slots ahead: ceil((60 + 5) / 16) = 5 blocks, but
    ceil((60 + 4) / 16) = 4 still fits."""
    path = tiny_model_dir("llama", num_hidden_layers=3)
    spec = {"method": "draft_model", "num_speculative_tokens": k, "num_draft_layers": 1}
    needed = -(-(MAX_MODEL_LEN + k) // BLOCK_SIZE)
    with pytest.raises(ValueError) as info:
        make(path, num_gpu_blocks_override=needed - 1, speculative_config=spec)
    msg = str(info.value)
    for part in (f"+ {k} lookahead slots (num_speculative_tokens)", f"needs {needed} blocks",
                 f"lower max_model_len to {(needed - 1) * BLOCK_SIZE - k}"):
        assert part in msg, msg
    llm = make(path, num_gpu_blocks_override=needed, speculative_config=spec)
    serves_one_max_length_request(llm, path)
    llm.shutdown()


def test_ngram_drafts_need_no_lookahead_slots(tiny_model_dir):
    """n-gram drafts are scheduled tokens within max_model_len: the plain pool serves."""
    path = tiny_model_dir("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match=f"needs {NEEDED} blocks"):
        make(path, num_gpu_blocks_override=NEEDED - 1, speculative_config=spec)
    llm = make(path, num_gpu_blocks_override=NEEDED, speculative_config=spec)
    serves_one_max_length_request(llm, path)
    llm.shutdown()


def test_lora_engines_are_checked_the_same_way(tiny_model_dir):
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=f"needs {NEEDED} blocks .* has {NEEDED - 1}"):
        make(path, num_gpu_blocks_override=NEEDED - 1, enable_lora=True)
    llm = make(path, num_gpu_blocks_override=NEEDED, enable_lora=True)
    serves_one_max_length_request(llm, path)
    llm.shutdown()
