"""Property-based fuzzing of the offline front doors (issue 14, items 3 and 4).

- ``EngineConfig`` / ``LLM(...)``: any config either raises a ``ValueError``
  naming the field *before any weight is read* (the loader is replaced by one
  that explodes), or builds an engine that works.
- ``LLM.generate``: bad and good ``SamplingParams`` and prompts (wrong types,
  extreme ints and floats, NaN and inf, huge, empty and nested prompts, bad
  token ids). Each call raises a ``ValueError``/``TypeError`` naming the field,
  or works; afterwards a fixed greedy prompt gives the same answer as before
  and the KV pool is fully free.

Bounded: the ``ci`` hypothesis profile (``CI=true``) is derandomised and small.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams

INTS = st.one_of(st.integers(-5, 300), st.sampled_from([0, -1, 2**31, 2**63, 2**64, 2**70]))
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.floats(allow_nan=True),
                 st.lists(st.integers(), max_size=2))


def _field_named(error: Exception, fields) -> bool:
    return any(re.search(rf"\b{f}\b", str(error)) for f in fields)


# -- EngineConfig -------------------------------------------------------------------------

CONFIG_FIELDS = {
    "block_size": st.one_of(st.integers(1, 32), INTS, JUNK),
    "max_num_seqs": st.one_of(st.integers(1, 8), INTS, JUNK),
    "max_num_batched_tokens": st.one_of(st.integers(16, 256), INTS, JUNK),
    "max_model_len": st.one_of(st.none(), st.integers(8, 128), INTS, JUNK),
    "kv_cache_memory": st.one_of(st.integers(1 << 20, 1 << 24), INTS, st.just(1 << 62), JUNK),
    "gpu_memory_utilization": st.one_of(st.floats(0.1, 1.0), st.floats(allow_nan=True), JUNK),
    "num_gpu_blocks_override": st.one_of(st.none(), st.integers(40, 80), INTS, JUNK),
    # No 2: under the fast linear twin that would spawn real worker processes.
    "tensor_parallel_size": st.one_of(st.sampled_from([1, 0, -1, 7, 2**70]), JUNK),
    "dtype": st.one_of(st.sampled_from(["auto", "float32", "fp32"]), st.text(max_size=6), JUNK),
    "device": st.one_of(st.sampled_from(["cpu", "auto"]), st.text(max_size=6), JUNK),
    "seed": st.one_of(st.integers(0, 10), INTS, JUNK),
    "enable_prefix_caching": st.one_of(st.booleans(), JUNK),
    "enable_chunked_prefill": st.one_of(st.booleans(), JUNK),
    "enforce_eager": st.one_of(st.booleans(), JUNK),
}


@st.composite
def configs(draw):
    """A config whose fields are mostly good, with one to three drawn from anywhere."""
    good = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                num_gpu_blocks_override=None, tensor_parallel_size=1, dtype="float32",
                device="cpu", seed=0)
    names = draw(st.lists(st.sampled_from(sorted(CONFIG_FIELDS)), min_size=1, max_size=3,
                          unique=True))
    for name in names:
        good[name] = draw(CONFIG_FIELDS[name])
    return good


class LoadedWeights(Exception):
    """The loader ran: the config was accepted before any weight was read."""


def _exploding_loader(*args, **kwargs):
    raise LoadedWeights()


#: Checks that need the model's config or its block size, so run after it is read.
AFTER_LOADING = ("max_model_len", "kv_cache_memory", "num_gpu_blocks_override",
                 "max_num_batched_tokens", "num_blocks")


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kw=configs())
def test_every_config_is_refused_before_loading_or_works(tiny_model_dir, monkeypatch, kw):
    from minivllm.model import loader

    path = str(tiny_model_dir("llama"))
    with monkeypatch.context() as m:
        m.setattr(loader, "load_model", _exploding_loader)
        try:
            LLM(path, **kw)
        except ValueError as e:
            assert _field_named(e, CONFIG_FIELDS), e
            return  # refused before loading
        except LoadedWeights:
            pass  # accepted: it must now build and serve
    try:
        llm = LLM(path, **kw)
        out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                           use_tqdm=False)[0]
    except ValueError as e:
        assert _field_named(e, AFTER_LOADING), e
        return
    assert len(out.outputs[0].token_ids) == 2
    assert llm.llm_engine.scheduler.num_free_blocks == llm.llm_engine.cache_config.num_blocks


def test_the_issue_cases_are_refused_before_loading(tiny_model_dir, monkeypatch):
    from minivllm.model import loader

    monkeypatch.setattr(loader, "load_model", _exploding_loader)
    path = str(tiny_model_dir("llama"))
    for field, value in [("block_size", 0), ("max_num_seqs", 0), ("max_num_seqs", True),
                         ("max_num_batched_tokens", -1), ("max_model_len", 0),
                         ("kv_cache_memory", 0), ("gpu_memory_utilization", math.nan),
                         ("num_gpu_blocks_override", 0), ("tensor_parallel_size", 0),
                         ("tensor_parallel_size", 1.0), ("dtype", "float64"),
                         ("device", "tpu"), ("seed", 2**70), ("enforce_eager", "no")]:
        with pytest.raises(ValueError, match=field):
            LLM(path, **{field: value})
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(path, block_sizes=16)


# -- LLM.generate -------------------------------------------------------------------------

FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, 1e308]))
PARAM_FIELDS = {
    "n": st.one_of(st.just(1), INTS, JUNK),
    "temperature": st.one_of(st.just(0.0), FLOATS, JUNK),
    "top_p": st.one_of(FLOATS, JUNK),
    "top_k": st.one_of(INTS, JUNK),
    "min_p": st.one_of(FLOATS, JUNK),
    "seed": st.one_of(st.none(), INTS, st.just(-(2**63)), st.just(2**64 - 1), JUNK),
    "presence_penalty": st.one_of(FLOATS, JUNK),
    "frequency_penalty": st.one_of(FLOATS, JUNK),
    "repetition_penalty": st.one_of(FLOATS, JUNK),
    "max_tokens": st.one_of(st.integers(1, 4), st.none(), INTS, JUNK),
    "min_tokens": st.one_of(st.integers(0, 3), INTS, JUNK),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3),
                      JUNK),
    "stop_token_ids": st.one_of(st.none(), st.lists(INTS, max_size=3), JUNK),
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "logprobs": st.one_of(st.none(), st.integers(0, 20), INTS, JUNK),
    "skip_special_tokens": st.one_of(st.booleans(), JUNK),
    "include_stop_str_in_output": st.one_of(st.booleans(), JUNK),
    "output_kind": st.one_of(st.integers(0, 2), INTS, JUNK),
}

PROMPTS = st.one_of(
    st.text(max_size=20),
    st.just("x" * 5000),  # longer than max_model_len
    st.just(""),
    st.lists(st.integers(0, 300), max_size=10).map(lambda ids: {"prompt_token_ids": ids}),
    st.lists(INTS, max_size=5).map(lambda ids: {"prompt_token_ids": ids}),
    st.just({"prompt_token_ids": list(range(200))}),
    st.just({"prompt_token_ids": [[1, 2], [3]]}),
    st.just({"prompt_token_ids": "12"}),
    st.just({"prompt": 12}),
    st.just({}),
    st.lists(st.text(max_size=3), max_size=3),  # a batch
    st.just([[1, 2, 3]]),  # nested lists are not a prompt form
    JUNK,
)


@st.composite
def sampling_kwargs(draw):
    kw = {"max_tokens": 3}
    for name in draw(st.lists(st.sampled_from(sorted(PARAM_FIELDS)), max_size=3, unique=True)):
        kw[name] = draw(PARAM_FIELDS[name])
    return kw


@pytest.fixture(scope="module")
def fuzz_llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", max_model_len=128,
              block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fixed = {"prompt_token_ids": [72, 101, 108, 108, 111]}
    want = llm.generate(fixed, greedy, use_tqdm=False)[0].outputs[0].token_ids
    return llm, fixed, greedy, want


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPTS, kw=sampling_kwargs())
def test_generate_raises_naming_the_field_or_works(fuzz_llm, prompt, kw):
    llm, fixed, greedy, want = fuzz_llm
    engine = llm.llm_engine
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        assert _field_named(e, PARAM_FIELDS), e
        params = None
    if params is not None:
        try:
            outs = llm.generate(prompt, params, use_tqdm=False)
        except (ValueError, TypeError) as e:
            assert _field_named(e, ("prompt", "prompts", "prompt_token_ids", "max_tokens",
                                    "max_model_len", "sampling_params")), e
        else:
            assert all(o.finished and o.error is None for o in outs)
    assert not engine.has_unfinished_requests() and not engine.output_processor.states
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks


def test_after_the_fuzz_the_engine_answers_as_before(fuzz_llm):
    # Runs after the fuzz test (file order): the fixed greedy prompt is unchanged.
    llm, fixed, greedy, want = fuzz_llm
    assert llm.generate(fixed, greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    engine = llm.llm_engine
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
