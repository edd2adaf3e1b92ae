"""Hypothesis strategies and settings profiles shared by every test module.

Profiles: ``dev`` (default, 50 examples), ``ci`` (``CI`` env set: fewer
examples, no deadline, derandomised so CI is reproducible), ``cuda``
(bigger grids on a GPU) and ``grade`` (``minivllm course grade``: the ``ci``
examples without the shrink phase, so a failing submission is reported in
seconds, with the example that failed). Select with ``HYPOTHESIS_PROFILE``.

The allocator and scheduler state machines are cheap (milliseconds per run),
so :func:`stateful_settings` gives them more runs and longer runs than the
profile's default on top of whichever profile is loaded: in CI they stay
derandomised (the same runs every time) but explore enough to reach shared
blocks, preemption and prefix-cache hits on purpose.
"""

from __future__ import annotations

import os
from types import MappingProxyType

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

_common = MappingProxyType(dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
settings.register_profile("dev", max_examples=50, **_common)
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("cuda", max_examples=200, **_common)
settings.register_profile("grade", max_examples=25, derandomize=True, print_blob=False,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def stateful_settings(max_examples: int, step_count: int) -> settings:
    """The loaded profile, with at least ``max_examples`` runs of up to ``step_count`` rules."""
    return settings(
        max_examples=max(max_examples, settings.default.max_examples),
        stateful_step_count=step_count,
    )


#: Awkward sizes the kernel tests draw from.
HEAD_DIMS = (64, 80, 96, 128)
SMALL_HEAD_DIMS = (8, 16, 24, 40)  # for the interpreter: small and not all powers of 2
GQA_RATIOS = (1, 2, 4, 8)
BLOCK_SIZES = (1, 8, 16, 32)


def block_sizes() -> st.SearchStrategy[int]:
    return st.sampled_from(BLOCK_SIZES)


def gqa_heads(max_kv_heads: int = 4) -> st.SearchStrategy[tuple[int, int]]:
    """(num_heads, num_kv_heads) with num_heads a multiple of num_kv_heads."""
    return st.tuples(st.integers(1, max_kv_heads), st.sampled_from(GQA_RATIOS)).map(
        lambda t: (t[0] * t[1], t[0])
    )


def token_ids(vocab_size: int, min_size: int = 1, max_size: int = 64) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab_size - 1), min_size=min_size, max_size=max_size)


# -- structured outputs: regexes and JSON schemas inside the ref's subsets -------------------

#: Characters a generated regex or schema is built from: ASCII letters and punctuation (the
#: regex metacharacters among them), a space, and 2-, 3- and 4-byte UTF-8 characters.
SO_CHARS = "ab-z09 .,:;\"\\/{}[]()*+?|^$éß中😀"


def _regex_escape_in_class(c: str) -> str:
    return "\\" + c if c in "]\\-[" else c


def regex_patterns(max_leaves: int = 8) -> st.SearchStrategy[str]:
    """Regexes in the subset ``minivllm.structured_output.regex`` reads (never empty languages).

    Leaves: a literal character (escaped when it is a metacharacter), a class
    (``[...]``, ``[^...]``, ranges), ``.``, ``\\d \\w \\s``; inner nodes: concatenation,
    alternation, groups, ``* + ? {m} {m,} {m,n}``.
    """
    from minivllm.structured_output.regex import escape

    chars = st.sampled_from(SO_CHARS)
    literal = chars.map(escape)
    # No '^' in classes: first in a class, xgrammar misreads it (the ref refuses it there).
    member = st.one_of(chars.filter(lambda c: c != "^").map(_regex_escape_in_class),
                       st.sampled_from(["a-f", "0-9", "à-ÿ", "\\d", "\\s", "\\w"]))
    klass = st.builds(lambda neg, items: "[" + ("^" if neg else "") + "".join(items) + "]",
                      st.booleans(), st.lists(member, min_size=1, max_size=3))
    leaf = st.one_of(literal, literal, klass, st.sampled_from([".", "\\d", "\\w", "\\s", "\\."]))

    def extend(inner):
        quant = st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?"])
        return st.one_of(
            st.lists(inner, min_size=2, max_size=3).map("".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
            st.builds(lambda x, q: "(?:" + x + ")" + q, inner, quant),
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def json_schemas(max_depth: int = 2) -> st.SearchStrategy[dict]:
    """JSON schemas in the ref's subset (``minivllm.structured_output.json_schema``)."""
    names = st.text(alphabet=SO_CHARS, min_size=1, max_size=4)
    values = st.one_of(st.text(alphabet=SO_CHARS, max_size=4), st.integers(-20, 300),
                       st.booleans(), st.none())
    length = st.one_of(st.none(), st.integers(0, 3))

    def string_schema(lo, hi):
        s = {"type": "string"}
        if lo is not None:
            s["minLength"] = lo
        if hi is not None:
            s["maxLength"] = max(hi, lo or 0)
        return s

    leaf = st.one_of(
        st.builds(string_schema, length, length),
        st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                         {"type": "null"}, {"type": ["integer", "null"]}]),
        st.lists(values, min_size=1, max_size=3).map(lambda vs: {"enum": vs}),
        values.map(lambda v: {"const": v}),
    )

    def array(items, lo, hi):
        s = {"type": "array", "items": items}
        if lo is not None:
            s["minItems"] = lo
        if hi is not None:
            s["maxItems"] = max(hi, lo or 0)
        return s

    def obj(props, required_flags):
        required = [k for k, r in zip(props, required_flags) if r]
        return {"type": "object", "properties": props, "required": required}

    def extend(inner):
        props = st.dictionaries(names, inner, min_size=0, max_size=3)
        return st.one_of(
            st.builds(array, inner, length, length),
            props.flatmap(lambda p: st.builds(obj, st.just(p),
                                              st.lists(st.booleans(), min_size=len(p),
                                                       max_size=len(p)))),
            st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}),
        )

    return st.recursive(leaf, extend, max_leaves=max_depth * 3)


#: Feature widths for the LoRA tests: small (the interpreter runs them) and mostly not
#: powers of 2.
LORA_FEATURES = (1, 5, 16, 24, 40, 57, 96)
#: Adapter ranks, 1 to 64 (the stack's ``max_rank``; each slot's own rank is at most it).
LORA_RANKS = (1, 2, 3, 8, 13, 16, 32, 64)


@st.composite
def lora_batches(draw, max_tokens: int = 40, max_slots: int = 5) -> dict:
    """One ``add_lora`` call's sizes: a mixed batch of tokens over adapter slots.

    Keys: ``num_tokens``, ``in_features``, ``output_slices`` (1 to 3 slices, as
    o_proj / gate_up / qkv), ``max_loras``, ``max_rank``, ``ranks`` (each slot's
    rank, 0 = an empty slot, the rest zero-padded), ``zero_scale`` (``(slice, slot)``
    pairs the adapter leaves alone), ``token_slots`` (-1 = no adapter, any order)
    and ``seed`` (for the tensors).
    """
    max_loras = draw(st.integers(1, max_slots))
    max_rank = draw(st.sampled_from(LORA_RANKS))
    num_slices = draw(st.integers(1, 3))
    return dict(
        num_tokens=(t := draw(st.integers(1, max_tokens))),
        in_features=draw(st.sampled_from(LORA_FEATURES)),
        output_slices=draw(st.lists(st.sampled_from(LORA_FEATURES), min_size=num_slices,
                                    max_size=num_slices)),
        max_loras=max_loras, max_rank=max_rank,
        ranks=draw(st.lists(st.integers(0, max_rank), min_size=max_loras, max_size=max_loras)),
        zero_scale=draw(st.sets(st.tuples(st.integers(0, num_slices - 1),
                                          st.integers(0, max_loras - 1)), max_size=2)),
        token_slots=draw(st.lists(st.integers(-1, max_loras - 1), min_size=t, max_size=t)),
        seed=draw(st.integers(0, 2**16)),
    )
