"""The scheduler under test (``backend.get("scheduler")``) against the ref scheduler.

A hypothesis state machine adds requests (shared prefixes that hit the prefix
cache, lengths on block boundaries, impossible ones that must be rejected),
steps both schedulers with a fake model whose sampled tokens hypothesis
draws (the same tokens for both), and aborts requests, on tiny pools and
budgets that force preemption and chunked prefill. After every rule both
must have made the same decisions and the pool must be consistent; at the
end every request must finish within a step limit (no hangs) and the whole
pool must be free again.

Besides the comparison with the ref, the machine keeps oracles of its own
(an instructor may hide the ref): it simulates the model runner's cache writes
and checks that every computed token's K/V slot holds that token *after that
request's own prefix* (so a prefix-cache hit on the wrong context fails), and
that a step which preempts admits nobody. Rules drive the rare paths on
purpose: groups of requests sharing a prefix, prompts built from a few block
contents (the same block after different parents must not hit), and stepping
until a preemption and then until a later admission. ``test_mutants.py`` runs
the machine against planted bugs to prove it finds them. Example tests pin the
individual rules.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minivllm import SamplingParams, backend
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.ref import scheduler as ref_scheduler
from minivllm.request import Request, RequestStatus
from minivllm.testing.strategies import stateful_settings

EOS = 0
PREFIXES = [list(range(100, 130)), list(range(200, 230))]  # shared system prompts


def _impl():
    return backend.get("scheduler").Scheduler


def _make_ref(scheduler_config: SchedulerConfig, cache_config: CacheConfig):
    # The oracle is ref all the way down, whatever --backend says.
    with backend.use_backend("ref"):
        return ref_scheduler.Scheduler(scheduler_config, cache_config)


def _request(req_id: str, prompt: list[int], max_tokens: int | None) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS)


def _summary(out) -> tuple:
    ids = [r.request_id for r in out.scheduled_requests]
    return (
        ids,
        [out.num_scheduled_tokens[i] for i in ids],
        out.total_num_scheduled_tokens,
        list(out.preempted_req_ids),
        list(out.finished_req_ids),
    )


def _fake_model_step(sched, out, draw_token) -> dict[str, int]:
    """Which scheduled requests sample (as the model runner decides) and what they get."""
    sampled = {}
    for r in out.scheduled_requests:
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens:
            sampled[r.request_id] = draw_token()
    return sampled


def check_pool(sched, num_blocks: int) -> None:
    """Blocks are owned by running requests only, counted right, and none leaked."""
    owners = Counter()
    for r in sched.running:
        blocks = sched.get_block_ids(r.request_id)
        assert len(blocks) == len(set(blocks)), f"{r.request_id} holds a block twice"
        assert len(blocks) * sched.block_size >= r.num_computed_tokens
        owners.update(blocks)
    for r in sched.waiting:
        assert sched.get_block_ids(r.request_id) == []
    alloc = sched.block_allocator
    free = alloc.get_free_block_ids()
    assert len(free) == len(set(free)) and not set(free) & set(owners), "held block is free"
    assert len(free) + len(owners) == num_blocks, "a block leaked"
    for b in range(num_blocks):
        assert alloc.ref_count(b) == owners[b], f"ref count of block {b}"
        if owners[b] > 1:
            assert alloc.get_block_hash(b) is not None, "shared block that is not cached"


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort traffic on the scheduler under test and the ref."""

    #: The scheduler class under test; None means the one the swap layer selects.
    impl_class = None

    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4, 16]),
        extra_blocks=st.integers(-2, 6),
        max_num_seqs=st.integers(1, 6),
        budget=st.one_of(st.integers(1, 8), st.integers(1, 40)),  # small: chunks, tight steps
        max_model_len=st.integers(6, 40),
        # Chunking on in most runs: chunks over cached, shared prefixes are where bugs hide.
        chunked=st.sampled_from([True, True, True, False]),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def make(self, block_size, extra_blocks, max_num_seqs, budget, max_model_len, chunked,
             caching, seed) -> None:
        # A pool just about the size of one longest request: lots of preemption. With
        # extra_blocks < 0 the longest requests can never fit and must be rejected.
        num_blocks = max(1, -(-max_model_len // block_size) + extra_blocks)
        if not chunked:
            budget = max(budget, max_model_len)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        )
        self.cache_config = CacheConfig(block_size, num_blocks, caching)
        self.impl = (self.impl_class or _impl())(self.scheduler_config, self.cache_config)
        self.ref = _make_ref(self.scheduler_config, self.cache_config)
        self.num_blocks = num_blocks
        self.rng = random.Random(seed)  # for the drain at teardown only
        self.next_id = 0
        self.accepted: list[str] = []
        self.rejected: list[str] = []
        self.prompts: list[list[int]] = []
        # Three block contents to build prompts from (tokens 40..99, apart from the rest).
        self.words = [[40 + 20 * k + j for j in range(block_size)] for k in range(3)]
        # (block, offset) -> fingerprint of the whole prefix whose last token's K/V is there.
        self.kv: dict[tuple[int, int], int] = {}

    def _ready(self) -> bool:
        return hasattr(self, "impl")

    @precondition(_ready)
    @rule(
        prefix=st.sampled_from([None, 0, 1]),
        prefix_len=st.integers(0, 20),
        tail=st.lists(st.integers(1, 30), max_size=8),
        repeat=st.booleans(),
        max_tokens=st.one_of(st.integers(1, 10), st.none(), st.integers(20, 60)),
    )
    def add(self, prefix, prefix_len, tail, repeat, max_tokens) -> None:
        if repeat and self.prompts:  # the very same prompt again: a full cache hit
            prompt = list(self.rng.choice(self.prompts))
        else:
            prompt = (PREFIXES[prefix][:prefix_len] if prefix is not None else []) + tail
        self._add(prompt, max_tokens)

    @precondition(_ready)
    @rule(
        words=st.lists(st.integers(0, 2), min_size=1, max_size=3),
        tail=st.lists(st.integers(1, 30), max_size=3),
        copies=st.integers(1, 3),
        max_tokens=st.integers(1, 8),
    )
    def add_from_blocks(self, words, tail, copies, max_tokens) -> None:
        """``copies`` requests whose prompts start with the same full blocks.

        The blocks come from three contents, so shared prefixes (ref counts > 1)
        and equal blocks under different parents (``A B`` then ``B B``: the second
        ``B`` must not hit the first) are both common.
        """
        prefix = [t for w in words for t in self.words[w]]
        for copy in range(copies):
            self._add(prefix + tail + [copy + 1], max_tokens)

    def _add(self, prompt: list[int], max_tokens: int | None) -> None:
        req_id = f"req{self.next_id}"
        self.next_id += 1
        errors = []
        for sched in (self.impl, self.ref):
            try:
                sched.add_request(_request(req_id, prompt, max_tokens))
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        assert errors[0] == errors[1]
        if errors[0] is None:
            self.accepted.append(req_id)
            self.prompts.append(prompt)
            # Double-check the rejection rules: an accepted request can always fit.
            req = self.impl.requests[req_id]
            assert 0 < len(prompt) and len(prompt) + req.max_tokens <= self.ref.max_model_len
        else:
            self.rejected.append(req_id)
            assert req_id not in self.impl.requests

    @precondition(_ready)
    @rule(data=st.data())
    def step(self, data) -> None:
        self._step(lambda: data.draw(st.one_of(st.just(EOS), st.integers(1, 30))))

    @precondition(_ready)
    @rule(
        words=st.lists(st.integers(0, 2), max_size=2),
        copies=st.integers(0, 3),
        seed=st.integers(0, 2**16),
    )
    def step_through_preemption(self, words, copies, seed) -> None:
        """Add requests that grow to ``max_model_len`` sharing a prefix, step until a step
        preempts, then until a later step admits a waiting request (the preempted one
        is at the queue's front).

        A victim that shares blocks with the requests still running, or that can
        restart with a small chunk, would fit again at once: exactly where admitting
        in the preempting step would show.
        """
        if copies:
            self.add_from_blocks(words, [], copies, None)
        rng = random.Random(seed)

        def draw_token():
            return rng.randrange(1, 31)  # no EOS: keep the pool under pressure

        max_steps = 2 * self.ref.max_model_len
        for _ in range(max_steps):
            if self._step(draw_token).preempted_req_ids:
                break
        else:
            return
        for _ in range(max_steps):
            waiting = {r.request_id for r in self.impl.waiting}
            out = self._step(draw_token)
            if any(r.request_id in waiting for r in out.scheduled_requests):
                break

    def _step(self, draw_token):
        running = {r.request_id for r in self.impl.running}
        out = self.impl.schedule()
        ref_out = self.ref.schedule()
        assert _summary(out) == _summary(ref_out)
        if out.preempted_req_ids:  # the pool is short: nobody new may be admitted
            scheduled = {r.request_id for r in out.scheduled_requests}
            assert scheduled <= running - set(out.preempted_req_ids), (
                f"step preempted {out.preempted_req_ids} and admitted "
                f"{sorted(scheduled - running)} or a preempted request")
        self._check_and_write_kv(out)
        assert out.total_num_scheduled_tokens <= self.scheduler_config.max_num_batched_tokens
        assert len(self.impl.running) <= self.scheduler_config.max_num_seqs
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        sampled = _fake_model_step(self.impl, out, draw_token)
        assert sampled.keys() == _fake_model_step(self.ref, ref_out, lambda: 0).keys()
        done = self.impl.update_from_output(out, sampled)
        ref_done = self.ref.update_from_output(ref_out, sampled)
        assert [r.request_id for r in done] == [r.request_id for r in ref_done]
        assert [r.status for r in done] == [r.status for r in ref_done]
        assert all(r.is_finished() for r in done)
        return out

    def _check_and_write_kv(self, out) -> None:
        """Play the model runner: every computed slot must hold the request's own prefix.

        A slot's content is a fingerprint of all tokens up to and including it, as
        real K/V depend on the whole prefix. Computed tokens (including prefix-cache
        hits) must find their own fingerprint; this step's new tokens write theirs.
        """
        bs = self.impl.block_size
        for r in out.scheduled_requests:
            blocks = self.impl.get_block_ids(r.request_id)
            start = r.num_computed_tokens
            end = start + out.num_scheduled_tokens[r.request_id]
            assert len(blocks) * bs >= end, f"{r.request_id}: no slot for token {end - 1}"
            fingerprint = 0
            for pos, token in enumerate(r.all_token_ids[:end]):
                fingerprint = hash((fingerprint, token))
                slot = (blocks[pos // bs], pos % bs)
                if pos < start:
                    assert self.kv.get(slot) == fingerprint, (
                        f"{r.request_id}: token {pos} reuses K/V of another prefix "
                        f"(block {slot[0]}, cached tokens {r.num_cached_tokens})")
                else:
                    self.kv[slot] = fingerprint

    @precondition(lambda self: self._ready() and self.accepted)
    @rule(data=st.data())
    def abort(self, data) -> None:
        req_id = data.draw(st.sampled_from(self.accepted + ["no-such-request"]))
        self.impl.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.ref.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    @invariant()
    def same_state_as_ref(self) -> None:
        if not self._ready():
            return
        impl, ref = self.impl, self.ref
        assert [r.request_id for r in impl.waiting] == [r.request_id for r in ref.waiting]
        assert [r.request_id for r in impl.running] == [r.request_id for r in ref.running]
        assert impl.get_num_unfinished_requests() == ref.get_num_unfinished_requests()
        assert impl.num_free_blocks == ref.num_free_blocks
        for req_id, r in impl.requests.items():
            o = ref.requests[req_id]
            assert (r.num_computed_tokens, r.status, r.num_preemptions, r.num_cached_tokens) == (
                o.num_computed_tokens, o.status, o.num_preemptions, o.num_cached_tokens)
            assert r.output_token_ids == o.output_token_ids
            assert impl.get_block_ids(req_id) == ref.get_block_ids(req_id)
        assert impl.block_allocator.get_free_block_ids() == ref.block_allocator.get_free_block_ids()

    @invariant()
    def pool_is_consistent(self) -> None:
        if self._ready():
            check_pool(self.impl, self.num_blocks)

    def teardown(self) -> None:
        if not self._ready():
            return
        # Every accepted request must finish: a generous bound on the steps needed
        # (the head of `running` computes >= 1 token every step and is never preempted).
        limit = 10 + self.impl.get_num_unfinished_requests() * (self.ref.max_model_len + 1)
        for _ in range(limit):
            if not self.impl.has_unfinished_requests():
                break
            self._step(lambda: self.rng.randrange(1, 31))
            self.pool_is_consistent()
        assert not self.impl.has_unfinished_requests(), f"no progress in {limit} steps"
        assert not self.ref.has_unfinished_requests()
        assert self.impl.num_free_blocks == self.num_blocks, "blocks still held at the end"
        assert self.impl.reset_prefix_cache()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = stateful_settings(max_examples=200, step_count=50)


# -- example tests ------------------------------------------------------------------------


def _sched(block_size=4, num_blocks=64, max_num_seqs=8, budget=64, max_model_len=64,
           chunked=True, caching=True):
    return _impl()(
        SchedulerConfig(max_num_seqs, budget, max_model_len, chunked),
        CacheConfig(block_size, num_blocks, caching),
    )


def _run_step(sched, token: int = 7):
    out = sched.schedule()
    sampled = _fake_model_step(sched, out, lambda: token)
    sched.update_from_output(out, sampled)
    return out


def test_fcfs_no_skipping():
    sched = _sched(num_blocks=6, budget=64)
    sched.add_request(_request("big", list(range(1, 17)), 4))  # 5 blocks
    sched.add_request(_request("blocked", list(range(50, 62)), 4))  # 4 blocks: won't fit
    sched.add_request(_request("small", [5], 1))  # 1 block would fit, but must wait its turn
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["big"]
    assert [r.request_id for r in sched.waiting] == ["blocked", "small"]


def test_chunked_prefill_mixes_with_decodes():
    sched = _sched(budget=8)
    sched.add_request(_request("a", [1, 2, 3], 5))
    _run_step(sched)  # a's prompt done, first token sampled
    sched.add_request(_request("b", list(range(10, 30)), 2))  # 20-token prompt
    out = _run_step(sched)
    # One decode for a, and the rest of the budget as b's first chunk.
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [r.request_id for r in out.scheduled_requests] == ["a", "b"]
    out = _run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert sched.requests["b"].num_output_tokens == 0  # still prefilling: nothing sampled


def test_chunking_disabled_waits_for_a_whole_prompt():
    sched = _sched(budget=20, max_model_len=20, chunked=False)
    sched.add_request(_request("a", [1, 2, 3], 5))
    sched.add_request(_request("c", [4, 5], 5))
    sched.add_request(_request("b", list(range(1, 20)), 1))  # 19 tokens
    out = _run_step(sched)
    assert out.num_scheduled_tokens == {"a": 3, "c": 2}  # b does not fit in the 15 left
    out = _run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}  # 19 > 20 - 2: still waiting
    assert [r.request_id for r in sched.waiting] == ["b"]
    chunked = _sched(budget=20, max_model_len=20, chunked=True)
    for req_id, prompt in [("a", [1, 2, 3]), ("c", [4, 5]), ("b", list(range(1, 20)))]:
        chunked.add_request(_request(req_id, prompt, 1))
    assert chunked.schedule().num_scheduled_tokens == {"a": 3, "c": 2, "b": 15}


def test_preemption_sends_tail_to_front_of_waiting():
    sched = _sched(block_size=2, num_blocks=4, budget=16, max_model_len=8, caching=False)
    sched.add_request(_request("a", [1, 2, 3, 4], 4))
    sched.add_request(_request("b", [5, 6, 7, 8], 4))
    sched.add_request(_request("c", [9], 1))
    out = _run_step(sched)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}  # 4 blocks used: c waits
    out = _run_step(sched)  # a, b decode into their second blocks: no room
    assert out.num_scheduled_tokens == {"a": 1} and list(out.preempted_req_ids) == ["b"]
    b = sched.requests["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert sched.get_block_ids("b") == []
    # b recomputes its prompt and its sampled token once a finishes.
    while "a" in sched.requests:
        _run_step(sched)
    out = _run_step(sched)
    assert out.num_scheduled_tokens["b"] == b.num_prompt_tokens + 1


def test_prefix_hit_leaves_one_token_to_compute():
    sched = _sched(block_size=4)
    prompt = list(range(1, 9))  # exactly two full blocks
    sched.add_request(_request("first", prompt, 1))
    _run_step(sched)  # computes both blocks and caches them; then finishes
    assert "first" not in sched.requests
    sched.add_request(_request("again", prompt, 1))
    sched.add_request(_request("longer", prompt + [50], 1))
    out = sched.schedule()
    again, longer = sched.requests["again"], sched.requests["longer"]
    # Whole prompt cached, but the last block is recomputed to get logits.
    assert again.num_cached_tokens == 4 and out.num_scheduled_tokens["again"] == 4
    assert longer.num_cached_tokens == 8 and out.num_scheduled_tokens["longer"] == 1
    # Both share the first cached block; "longer" also reuses the second one.
    assert sched.get_block_ids("longer")[0] == sched.get_block_ids("again")[0]
    shared = sched.get_block_ids("longer")[0]
    assert sched.block_allocator.ref_count(shared) == 2


def test_rejections():
    sched = _sched(block_size=4, num_blocks=3, max_model_len=16)
    with pytest.raises(ValueError, match="at least 1 token"):
        sched.add_request(_request("empty", [], 1))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(_request("long", list(range(1, 15)), 3))
    with pytest.raises(ValueError, match="no room"):
        sched.add_request(_request("full", list(range(1, 17)), None))
    with pytest.raises(ValueError, match="num_blocks=3"):
        sched.add_request(_request("pool", list(range(1, 11)), 3))  # 13 tokens: 4 blocks
    with pytest.raises(ValueError, match="num_blocks=3"):
        sched.add_request(_request("none", [1], None))  # max_tokens=None means 15 more
    sched.add_request(_request("ok", [1], 11))  # 12 tokens: exactly the pool
    roomy = _sched(block_size=4, num_blocks=4, max_model_len=16)
    roomy.add_request(_request("ok", [1], None))
    assert roomy.requests["ok"].max_tokens == 15
    with pytest.raises(ValueError, match="already"):
        sched.add_request(_request("ok", [1], 1))
    assert sched.get_num_unfinished_requests() == 1


def test_abort_frees_blocks():
    sched = _sched(num_blocks=8)
    sched.add_request(_request("a", list(range(1, 10)), 5))
    sched.add_request(_request("b", [1], 5))
    _run_step(sched)
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == 8
    assert list(sched.schedule().finished_req_ids) == ["a", "b"]
