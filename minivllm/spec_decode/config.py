"""``SpeculativeConfig``: how a request is speculated, as vLLM's ``speculative_config``.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 3})``
builds one of these with :meth:`SpeculativeConfig.from_dict` (``EngineConfig``
checks it before anything is loaded; see ``docs/speculative_decoding.md``). Field names
and defaults follow vLLM (``vllm/config/speculative.py``); every value is
checked when the object is made, and a bad one raises ``ValueError`` naming
the field, the value and the allowed range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from minivllm.spec_decode.metadata import MAX_SPEC_LEN

#: The proposers: ``ngram`` (prompt lookup in the request's own tokens) and
#: ``draft_model`` (a smaller model, or the target's first layers: self-speculation).
METHODS = ("ngram", "draft_model")

#: vLLM's default n-gram length when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{name} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SpeculativeConfig:
    """One engine's speculative decoding settings.

    Args:
        num_speculative_tokens: ``k``, the most draft tokens proposed per request
            and step, in ``[1, MAX_SPEC_LEN]``. The target then scores ``k + 1``
            positions per request in one forward pass.
        method: ``"ngram"`` or ``"draft_model"``.
        prompt_lookup_min / prompt_lookup_max: n-gram only. The proposer looks
            for the longest suffix of the request's tokens, of a length in
            ``[prompt_lookup_min, prompt_lookup_max]``, that occurred earlier,
            and proposes the tokens that followed it. As in vLLM: if neither is
            given both are 5; if one is given the other copies it.
        model: draft_model only: a path to the draft model (same tokenizer as
            the target). ``None`` means self-speculation with the target itself.
        num_draft_layers: draft_model only: use the first ``L`` decoder layers
            of the draft model (the target when ``model`` is None) plus its final
            norm and lm_head (LayerSkip-style self-speculation). ``None``: every
            layer. The upper bound (the model's layer count) is checked when
            the model is loaded.
        disable_by_batch_size: turn speculation off for a step with at least
            this many running requests (vLLM's name): at large batches a step is
            compute-bound and verifying drafts costs more than it saves.
            ``None``: never.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", self.method, f"one of {list(METHODS)}")
        k = self.num_speculative_tokens
        _check(_is_int(k) and 1 <= k <= MAX_SPEC_LEN, "num_speculative_tokens", k,
               f"an int in [1, {MAX_SPEC_LEN}]")
        if self.disable_by_batch_size is not None:
            _check(_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 2,
                   "disable_by_batch_size", self.disable_by_batch_size, "None or an int >= 2")
        if self.method == "ngram":
            self._resolve_prompt_lookup()
            for name in ("model", "num_draft_layers"):
                _check(getattr(self, name) is None, name, getattr(self, name),
                       "None with method 'ngram'")
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                _check(getattr(self, name) is None, name, getattr(self, name),
                       "None with method 'draft_model'")
            _check(self.model is None or (isinstance(self.model, str) and self.model != ""),
                   "model", self.model, "None (self-speculation) or a non-empty path")
            if self.num_draft_layers is not None:
                _check(_is_int(self.num_draft_layers) and self.num_draft_layers >= 1,
                       "num_draft_layers", self.num_draft_layers, "None or an int >= 1")

    def _resolve_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check(_is_int(lo) and lo >= 1, "prompt_lookup_min", lo, "an int >= 1")
        _check(_is_int(hi) and hi >= lo, "prompt_lookup_max", hi,
               f"an int >= prompt_lookup_min={lo}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @property
    def is_self_speculation(self) -> bool:
        """The draft is the target's own first layers (no separate model)."""
        return self.method == "draft_model" and self.model is None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Build from vLLM's ``speculative_config`` dict; unknown keys are an error."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; "
                             f"the keys are {sorted(known)}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**config)
