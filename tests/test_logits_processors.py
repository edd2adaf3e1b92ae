"""The logits_processors component and the logits-processor interface.

- The ref and fast twins of the built-ins (``allowed_token_ids``, ``bad_words``,
  ``logit_bias``) give bit-identical logits, over several steps of a batch
  whose rows are reordered, removed and added (hypothesis), and both equal an
  oracle written from vLLM's documented meaning, not from either twin:
  ``logits + B`` with ``-inf`` where a token is not allowed, or where
  appending it would complete a bad word.
- :class:`LogitsShaper` tells processors of added and removed requests and of
  each step's rows (draft positions included), leaves the input logits alone,
  and reports requests left with no token.
- ``SamplingParams`` validation of the new fields, and the loader of custom
  processors, name the field.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import examples

from minivllm import SamplingParams
from minivllm.fast import logits_processors as fast_lp
from minivllm.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
    load_logits_processor,
)
from minivllm.ref import logits_processors as ref_lp
from minivllm.request import Request
from minivllm.worker.logits_shaping import LogitsShaper

NEG_INF = float("-inf")


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    """Random shaping params over a small alphabet (so bad words do match)."""
    alphabet = min(vocab, 4)
    kw = {}
    if rng.random() < 0.6:
        scale = rng.choice([1e-3, 1.0, 100.0])
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-scale, scale)
                            for _ in range(rng.randrange(0, 5))}
    if rng.random() < 0.4:
        kw["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(1, vocab))
    sp = SamplingParams(**kw)
    if rng.random() < 0.6:
        sp._bad_words_token_ids = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
                                   for _ in range(rng.randint(1, 3))]
    return sp


def oracle(logits: torch.Tensor, params: list[SamplingParams], pasts: list[list[int]]
           ) -> torch.Tensor:
    """vLLM's meaning, from the formula: ``logits + B``, then ``-inf`` where forbidden.

    A token is forbidden in a row if ``allowed_token_ids`` leaves it out, or if
    appending it to the row's past tokens makes them end with a bad word.
    """
    n, vocab = logits.shape
    bias = torch.zeros(n, vocab)
    forbidden = torch.zeros(n, vocab, dtype=torch.bool)
    for i, (p, past) in enumerate(zip(params, pasts)):
        for t, b in (p.logit_bias or {}).items():
            bias[i, t] = b
        if p.allowed_token_ids:
            forbidden[i] = True
            forbidden[i, p.allowed_token_ids] = False
        for word in p.bad_words_token_ids or []:
            t = word[-1]
            if (past + [t])[-len(word):] == word and len(past) + 1 >= len(word):
                forbidden[i, t] = True
    return torch.where(forbidden, torch.tensor(NEG_INF), logits + bias)


def _random_logits(rng: random.Random, n: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    scale = rng.choice([1e-4, 1.0, 1e4])
    logits = torch.randn(n, vocab, generator=g) * scale
    if n and rng.random() < 0.3:  # a row partly or wholly -inf (a grammar's mask)
        row = rng.randrange(n)
        logits[row, : rng.randint(1, vocab)] = NEG_INF
    return logits


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([1, 2, 5, 17, 67]),
       steps=st.integers(1, 3))
def test_twins_equal_each_other_and_the_oracle_over_changing_batches(seed, vocab, steps):
    rng = random.Random(seed)
    config = LogitsProcessorConfig(vocab_size=vocab)
    twins = [m.builtin_processors(config, torch.device("cpu")) for m in (ref_lp, fast_lp)]
    live: dict[str, tuple[SamplingParams, list[int]]] = {}
    next_id = 0
    for _ in range(steps):
        removed = [rid for rid in live if rng.random() < 0.3]
        for rid in removed:
            del live[rid]
        added = []
        for _ in range(rng.randint(0 if live else 1, 3)):
            rid = f"r{next_id}"
            next_id += 1
            out = [rng.randrange(min(vocab, 4)) for _ in range(rng.randrange(0, 5))]
            live[rid] = (_params(rng, vocab), out)
            added.append((rid, live[rid][0], [0], out))
        order = list(live)
        rng.shuffle(order)
        rows, row_drafts, params, pasts = [], [], [], []
        for rid in order:  # some requests verify drafts: one row per draft position + 1
            drafts = tuple(rng.randrange(min(vocab, 4)) for _ in range(rng.choice([0, 0, 2])))
            for j in range(len(drafts) + 1):
                rows.append(rid)
                row_drafts.append(drafts[:j])
                params.append(live[rid][0])
                pasts.append(list(live[rid][1]) + list(drafts[:j]))
        update = BatchUpdate(tuple(added), tuple(removed), tuple(rows), tuple(row_drafts))
        logits = _random_logits(rng, len(rows), vocab)
        outs = []
        for procs in twins:
            x = logits.clone()
            for p in procs:
                p.update_state(update)
                x = p.apply(x)
            outs.append(x)
        assert torch.equal(outs[0], outs[1]), "ref and fast twins differ"
        want = oracle(logits, params, pasts)
        assert torch.equal(outs[0], want), "the twins differ from the oracle"
        for rid in order:  # the requests generate: their live output lists grow
            live[rid][1].append(rng.randrange(min(vocab, 4)))


def test_bad_words_edge_cases_against_hand_worked_rows():
    """A one-token word is always banned; a longer one only after its prefix; a prefix
    longer than the past never matches; with drafts, each position sees those before it."""
    vocab = 6
    sp = SamplingParams()
    sp._bad_words_token_ids = [[5], [1, 2, 3], [4, 4]]
    for mod in (ref_lp, fast_lp):
        p = mod.BadWordsLogitsProcessor(LogitsProcessorConfig(vocab), "cpu", False)
        out = [1]
        p.update_state(BatchUpdate([("a", sp, [0], out)], [], ["a", "a", "a"],
                                   [(), (2,), (2, 4)]))
        got = p.apply(torch.zeros(3, vocab))
        banned = [[t for t in range(vocab) if got[r, t] == NEG_INF] for r in range(3)]
        # row 0: past [1]; row 1: past [1, 2] -> 3 banned; row 2: past [1, 2, 4] -> 4 banned
        assert banned == [[5], [3, 5], [4, 5]], mod.__name__


def test_allowed_token_ids_keeps_exactly_the_allowed_logits():
    vocab = 9
    sp = SamplingParams(allowed_token_ids=[8, 0, 3])
    logits = torch.randn(2, vocab)
    for mod in (ref_lp, fast_lp):
        p = mod.AllowedTokenIdsLogitsProcessor(LogitsProcessorConfig(vocab), "cpu", False)
        p.update_state(BatchUpdate([("a", sp, [0], [])], [], ["b", "a"], [(), ()]))
        got = p.apply(logits.clone())
        assert torch.equal(got[0], logits[0]), "a row without the control is untouched"
        finite = torch.isfinite(got[1]).nonzero().flatten().tolist()
        assert finite == [0, 3, 8] and torch.equal(got[1, finite], logits[1, finite])


# -- the engine's shaper: what processors are told ------------------------------------


class Recorder(LogitsProcessor):
    """A custom processor that records every update and bans token 0 everywhere."""

    def __init__(self, config, device, is_pin_memory):
        self.updates: list[BatchUpdate] = []
        self.live: set[str] = set()

    def update_state(self, batch_update):
        self.updates.append(batch_update)
        self.live -= set(batch_update.removed)
        self.live |= {a[0] for a in batch_update.added}
        assert set(batch_update.rows) <= self.live

    def apply(self, logits):
        logits[:, 0] = NEG_INF
        return logits

    def is_argmax_invariant(self):
        return False


def _req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2], SamplingParams(**kw))


def test_shaper_tells_processors_of_adds_removes_rows_and_drafts():
    vocab = 7
    shaper = LogitsShaper(fast_lp, [Recorder], LogitsProcessorConfig(vocab), "cpu")
    rec = shaper.processors[-1]
    a, b = _req("a"), _req("b", logit_bias={3: 1.5})
    logits = torch.randn(1 + 3, vocab)
    before = logits.clone()
    shaped, dead = shaper.apply(logits, [a, b], [(4, 5), ()])
    assert torch.equal(logits, before), "the input logits are not modified"
    assert not dead
    u = rec.updates[-1]
    assert [x[0] for x in u.added] == ["a", "b"] and not u.removed
    assert list(u.rows) == ["a", "a", "a", "b"]
    assert list(u.row_drafts) == [(), (4,), (4, 5), ()]
    assert u.added[0][3] is a.output_token_ids, "the live output list, not a copy"
    assert (shaped[:, 0] == NEG_INF).all() and shaped[3, 3] == before[3, 3] + 1.5
    shaper.remove_request("a")
    shaper.remove_request("never-seen")  # never sampled: nobody is told
    c = _req("c")
    shaper.apply(torch.randn(2, vocab), [c, b], [(), ()])
    u = rec.updates[-1]
    assert list(u.removed) == ["a"] and [x[0] for x in u.added] == ["c"]
    assert list(u.rows) == ["c", "b"] and rec.live == {"b", "c"}


def test_shaper_does_nothing_when_no_request_shapes():
    shaper = LogitsShaper(ref_lp, [], LogitsProcessorConfig(5), "cpu")
    logits = torch.randn(2, 5)
    shaped, dead = shaper.apply(logits, [_req("a"), _req("b")], [(), ()])
    assert shaped is logits and not dead


def test_shaper_reports_a_request_left_with_no_token():
    sp = SamplingParams(allowed_token_ids=[2])
    sp._bad_words_token_ids = [[2]]
    a, b = Request("a", [1], sp), _req("b", allowed_token_ids=[1])
    shaper = LogitsShaper(fast_lp, [], LogitsProcessorConfig(4), "cpu")
    shaped, dead = shaper.apply(torch.randn(2, 4), [a, b], [(), ()])
    assert [r.request_id for r, _ in dead] == ["a"]
    assert "allowed_token_ids" in str(dead[0][1])
    assert math.isfinite(shaped[1, 1]) and (shaped[1, [0, 2, 3]] == NEG_INF).all()


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={"\u00b2": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
    (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=["ok", "  "]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
    (dict(extra_args=[1]), "extra_args"),
])
def test_bad_shaping_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logit_bias_is_clamped_and_its_keys_made_ints_as_vllm_does():
    sp = SamplingParams(logit_bias={"7": 250, 3: -1e9, 4: 0.25})
    assert sp.logit_bias == {7: 100.0, 3: -100.0, 4: 0.25}


def test_load_logits_processor_forms():
    path = f"{Recorder.__module__}:Recorder"
    assert load_logits_processor(Recorder) is Recorder
    assert load_logits_processor(path) is Recorder
    assert load_logits_processor(f"{Recorder.__module__}.Recorder") is Recorder
    for bad in ("no.such.module:X", f"{Recorder.__module__}:Nope", int, "math:pi"):
        with pytest.raises(ValueError, match="logits_processors"):
            load_logits_processor(bad)
