"""vLLM's request fields that minivllm refuses, and why.

A vLLM user's request is honoured or refused, never silently ignored: every
field of vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` is either
a field of :mod:`.protocol`'s request models (honoured with vLLM's meaning, or
checked there) or listed here. A listed field sent with a value that asks for
something (anything but its :attr:`Refusal.inert` values, vLLM's defaults) is
a 400 that names it and says why; with an inert value it is accepted, as vLLM
accepts it. A field vLLM itself does not know is ignored and logged, as vLLM
does (:meth:`~minivllm.entrypoints.openai.protocol._Request.ignored_fields`).

The table in ``tests/test_vllm_fields.py`` lists every vLLM field with its
status and is checked against these models and this list; ``docs/coming_from_vllm.md``
says the same for readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

BOTH = ("completions", "chat")


@dataclass(frozen=True)
class Refusal:
    """Why a vLLM field is refused, the values that ask for nothing, and where vLLM has it.

    Attributes:
        reason: the end of the 400's message (why minivllm cannot honour it).
        inert: values accepted because they ask for nothing (vLLM's defaults).
        endpoints: ``"completions"`` and/or ``"chat"``: the requests vLLM has it on
            (on the other, vLLM ignores it, and so does minivllm).
    """

    reason: str
    inert: tuple[Any, ...] = (None,)
    endpoints: tuple[str, ...] = BOTH


REFUSED: MappingProxyType[str, Refusal] = MappingProxyType({
    "prompt_embeds": Refusal("minivllm's models take token ids, not embeddings",
                             endpoints=("completions",)),
    "mm_processor_kwargs": Refusal("minivllm serves text-only models (there is no "
                                   "multimodal processor)", inert=(None, {}),
                                   endpoints=("chat",)),
    "logits_processors": Refusal("minivllm runs no user code in its sampler (vLLM too "
                                 "refuses them without --logits-processor-pattern)",
                                 inert=(None, [])),
    "cache_salt": Refusal("minivllm's prefix cache has no per-request salt; a server "
                          "shared by mutually distrusting users should run with "
                          "--no-prefix-caching"),
    "kv_transfer_params": Refusal("minivllm has no disaggregated prefill (no KV transfer "
                                  "between instances)", inert=(None, {})),
    "vllm_xargs": Refusal("minivllm has no custom extensions to read them", inert=(None, {})),
    "reasoning_effort": Refusal("minivllm has no reasoning models (no harmony format, no "
                                "--reasoning-parser)", endpoints=("chat",)),
    "include_reasoning": Refusal("minivllm has no --reasoning-parser, so no reasoning is "
                                 "told apart from the answer to leave out",
                                 inert=(None, True), endpoints=("chat",)),
    "return_token_ids": Refusal("minivllm's responses carry no token ids (ask /tokenize, "
                                "or use the offline LLM's RequestOutput.token_ids)",
                                inert=(None, False)),
})


def refusal_message(name: str, value: Any, endpoint: str) -> str | None:
    """The 400's message if ``name`` (an unknown field of an ``endpoint`` request) is
    refused with ``value``; None if it is not refused here (inert, or not listed)."""
    refusal = REFUSED.get(name)
    if refusal is None or endpoint not in refusal.endpoints:
        return None
    if any(value == v and type(value) is type(v) for v in refusal.inert):
        return None
    return f"{name} is not supported by minivllm: {refusal.reason}; leave it out"


def known_to_vllm(name: str, endpoint: str) -> bool:
    """True if ``name`` is one of the refused vLLM fields of ``endpoint`` (so it is not
    an unknown field to be logged as ignored)."""
    refusal = REFUSED.get(name)
    return refusal is not None and endpoint in refusal.endpoints
