"""``SpeculativeConfig``: vLLM's defaults, and a ValueError naming the field for bad values."""

from __future__ import annotations

import pytest

from minivllm.spec_decode.config import SpeculativeConfig


def test_speculative_config_defaults_follow_vllm():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(3, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(3, prompt_lookup_min=2).prompt_lookup_max == 2
    self_spec = SpeculativeConfig(5, method="draft_model", num_draft_layers=10)
    assert self_spec.is_self_speculation and self_spec.model is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=33), "num_speculative_tokens"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens"),
    (dict(num_speculative_tokens=3, method="eagle"), "method"),
    (dict(num_speculative_tokens=3, prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=2),
     "prompt_lookup_max"),
    (dict(num_speculative_tokens=3, model="x"), "model"),
    (dict(num_speculative_tokens=3, method="draft_model", prompt_lookup_min=2),
     "prompt_lookup_min"),
    (dict(num_speculative_tokens=3, method="draft_model", num_draft_layers=0),
     "num_draft_layers"),
    (dict(num_speculative_tokens=3, method="draft_model", model=""), "model"),
    (dict(num_speculative_tokens=3, disable_by_batch_size=1), "disable_by_batch_size"),
])
def test_speculative_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field} must be"):
        SpeculativeConfig(**kwargs)


def test_speculative_config_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ValueError, match="unknown keys.*'k'"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "k": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="must be a dict"):
        SpeculativeConfig.from_dict(3)
