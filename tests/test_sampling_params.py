"""SamplingParams: vLLM's defaults, and a ValueError naming the field for every bad value."""

from __future__ import annotations

import math

import pytest

from minivllm.sampling_params import SamplingParams

#: vLLM's SamplingParams defaults (vllm/sampling_params.py), written out by hand.
VLLM_DEFAULTS = dict(
    n=1,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    seed=None,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    max_tokens=16,
    min_tokens=0,
    stop_token_ids=[],
    ignore_eos=False,
    logprobs=None,
    skip_special_tokens=True,
    include_stop_str_in_output=False,
)


@pytest.mark.parametrize("name", sorted(VLLM_DEFAULTS))
def test_defaults_match_vllm(name):
    assert getattr(SamplingParams(), name) == VLLM_DEFAULTS[name]


def test_default_stop_is_empty():
    p = SamplingParams()
    assert p.stop_strings == [] and not p.greedy


BAD_VALUES = [
    ("n", 0),
    ("n", -1),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("seed", 1.5),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("min_tokens", -1),
    ("logprobs", -2),  # -1 is vLLM's whole vocabulary; the engine's max_logprobs caps the rest
    ("stop", [""]),
    ("stop", ""),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("stop", {"a": 1}),
    # Non-finite floats in every float field.
    *[(f, v) for f in ("temperature", "top_p", "min_p", "presence_penalty",
                       "frequency_penalty", "repetition_penalty")
      for v in (math.inf, -math.inf, math.nan)],
    # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1] only.
    ("seed", 2**70),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", True),
    ("seed", "7"),
    ("top_k", 2**64),
    ("top_k", True),
    ("max_tokens", 2**63),
    ("max_tokens", 3.0),
    ("min_tokens", 1.5),
    ("logprobs", True),
    ("n", "1"),
    ("temperature", "0.5"),
    ("temperature", True),
    ("ignore_eos", 1),
    ("skip_special_tokens", None),
    ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_raises_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=5, max_tokens=None)  # no limit: fine


GOOD_VALUES = [
    ("n", 4),  # parallel sampling: n completions of one prompt
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("top_p", 1e-3),
    ("top_k", 1),
    ("min_p", 1.0),
    ("presence_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("repetition_penalty", 0.5),
    ("max_tokens", 1),
    ("logprobs", 0),
    ("logprobs", 20),
    ("seed", 0),
    ("seed", 2**64 - 1),
    ("seed", -(2**63)),
    ("temperature", 1),
    ("stop", "###"),
]


@pytest.mark.parametrize(("name", "value"), GOOD_VALUES, ids=[f"{n}={v!r}" for n, v in GOOD_VALUES])
def test_edge_values_accepted(name, value):
    assert getattr(SamplingParams(**{name: value}), name) == value


def test_normalisations():
    assert SamplingParams(top_k=-1).top_k == 0  # -1 and 0 both mean "off"
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(temperature=0.0).greedy
    with pytest.warns(UserWarning, match="temperature"):
        p = SamplingParams(temperature=1e-4)  # vLLM raises tiny temperatures to 1e-2
    assert p.temperature == pytest.approx(1e-2) and not p.greedy


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), -1, 0, 2**63])
def test_every_accepted_seed_seeds_a_torch_generator(seed):
    import torch

    torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
