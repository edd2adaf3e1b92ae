"""Sharing blocks by fork, with copy-on-write: the KV cache manager under test against the ref.

A hypothesis state machine plays a scheduler and a worker around two KV cache
managers, the one under test (``backend.get("kv_cache_manager")``) and the
ref, each on a ref block allocator: requests are added (prefix-cache hits on
shared prompts when caching is on), forked (parallel sampling, a branching
beam), decoded (with lookahead slots now and then), preempted and re-admitted,
finished, in small pools. A step is: allocations, then ``forward``, which
drains the step's copies and rows to refresh, applies them to a block table
(``backend.get("block_table")``, as a worker does), runs the copies and writes
each computed token's *content* (the token prefix it was computed under) into
a simulated cache, and poisons every free, uncached block.

After every rule, against its own bookkeeping (not the ref's):

- reference counts never go negative and equal the number of holders (the
  requests holding the block, plus the hold a freed request's block keeps
  while a copy of the step still reads or writes it);
- no block leaks: free + held + kept for copies == the pool, after each step;
- every block a step writes (its tokens and lookahead slots) has reference
  count 1 once ``allocate_slots`` returned: a shared block is never written;
- the copies reported are exactly the copies-on-write it predicted: one per
  shared block in the written range, fresh destination, in order; and the
  requests to refresh are exactly those that copied;
- the worker's table (the ref's), updated with appends, new rows and
  refreshed rows, equals the manager's lists; every live request's computed slots hold the
  content of its own prefix (so a missed, reversed or late copy, or a block
  freed while shared, shows);
- the implementation and the ref make the same decisions (block lists,
  free queue order, hashes, copies).

The manager under test is the only part that is not the ref (it is course task
20's). Example tests pin the rules one at a time. The NaN-poisoned run with
real tensors, and every component under test, is ``tests/test_fork_cow_cache.py``.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm import SamplingParams, backend
from minivllm.ref import kv_cache_manager as ref_kv_cache_manager
from minivllm.ref.block_allocator import BlockAllocator as RefAllocator
from minivllm.ref.block_table import BlockTables as RefBlockTables
from minivllm.request import Request
from minivllm.testing.strategies import stateful_settings

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8, 9], [7] * 5, [1, 2, 3]]


def _manager(alloc):
    return backend.get("kv_cache_manager").KVCacheManager(alloc)


def _content(tokens: list[int], pos: int) -> tuple[int, ...]:
    """What slot ``pos`` holds once computed: K/V depend on every token up to ``pos``."""
    return tuple(tokens[: pos + 1])


class ForkMachine(RuleBasedStateMachine):
    """Add / fork / decode / preempt / re-admit / finish / forward, impl and ref side by side."""

    # Pools from "one prompt barely fits" to a few sequences' worth: forks, copies that
    # do not fit, preemption and prefix hits on freed blocks all happen.
    @initialize(extra_blocks=st.integers(0, 8), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans())
    def make(self, extra_blocks: int, block_size: int, caching: bool) -> None:
        num_blocks = -(-12 // block_size) + extra_blocks  # the longest prompt + a token fits
        self.bs, self.num_blocks = block_size, num_blocks
        self.impl_alloc = RefAllocator(num_blocks, block_size, caching)
        self.ref_alloc = RefAllocator(num_blocks, block_size, caching)
        self.impl = _manager(self.impl_alloc)
        self.ref = ref_kv_cache_manager.KVCacheManager(self.ref_alloc)
        # The worker's side is the ref's: this machine grades the manager alone (course task).
        self.tables = RefBlockTables(64, num_blocks, block_size)
        self.running: dict[str, tuple[Request, Request]] = {}  # holding blocks: (impl, ref)
        self.waiting: dict[str, tuple[Request, Request]] = {}  # preempted
        self.cache: list[list] = [[None] * block_size for _ in range(num_blocks)]  # None = NaN
        self.next_id = self.next_token = 0
        self._open_step()

    def _open_step(self) -> None:
        self.writes: dict[str, tuple[int, int, int]] = {}  # id -> (start, end, end + lookahead)
        self.appended: dict[str, list[int]] = {}  # id -> blocks appended this step
        self.new_rows: set[str] = set()
        self.removed: set[str] = set()
        self.expected_copies: list[tuple[int, int]] = []
        self.expected_refresh: set[str] = set()
        self.kept = Counter()  # blocks a freed request keeps for this step's copies

    # -- helpers ----------------------------------------------------------------------

    def _token(self) -> int:
        self.next_token += 1
        return 100 + self.next_token

    def _holders(self) -> Counter:
        return Counter(b for i in self.running for b in self.impl.get_block_ids(i))

    def _pick(self, pool: dict, index: int) -> str | None:
        ids = sorted(pool)
        return ids[index % len(ids)] if ids else None

    def _allocate(self, req_id: str, pair, num_new: int, hits=(), lookahead: int = 0) -> bool:
        """Both managers allocate; check the outcome against the predicted copies-on-write."""
        impl_req, ref_req = pair
        before = self.impl.get_block_ids(req_id)
        start = impl_req.num_computed_tokens + len(hits) * self.bs
        end, end_la = start + num_new, start + num_new + lookahead
        holders = self._holders()
        shared = [i for i in range(start // self.bs, min(len(before), -(-end_la // self.bs)))
                  if holders[before[i]] + self.kept[before[i]] > 1] if end_la > start else []
        kw = {"num_lookahead_tokens": lookahead} if lookahead else {}
        free_before = self.impl_alloc.get_free_block_ids()
        got = self.impl.allocate_slots(impl_req, num_new, hits, **kw)
        assert got == self.ref.allocate_slots(ref_req, num_new, hits, **kw)
        if got is None:
            event("allocate_slots refused" + (" (a copy needed)" if shared else ""))
            assert self.impl.get_block_ids(req_id) == before, "a refusal changed the blocks"
            assert self.impl_alloc.get_free_block_ids() == free_before
            return False
        after = self.impl.get_block_ids(req_id)
        head = [*before, *hits]
        assert after[len(head):] == got, "the returned blocks are not the ones appended"
        for i, old in enumerate(head):
            if i in shared:
                fresh = after[i]
                assert holders[fresh] == self.kept[fresh] == 0, "COW needs a fresh block"
                self.expected_copies.append((old, fresh))
            else:
                assert after[i] == old, f"block {i} replaced though not shared"
        if shared:
            self.expected_refresh.add(req_id)
            event("copy-on-write" + (" of a lookahead block" if end_la > end and
                                     any(i * self.bs >= end for i in shared) else ""))
        # Every block this step writes (tokens and lookahead slots) is the request's alone.
        for pos in range(start, end_la):
            block = after[pos // self.bs]
            assert self.impl_alloc.ref_count(block) == 1, (
                f"position {pos} lands in block {block}, shared "
                f"(ref count {self.impl_alloc.ref_count(block)}): a shared block is written")
        self.writes[req_id] = (start, end, end_la)
        self.appended.setdefault(req_id, []).extend(got)
        return True

    def _admit(self, req_id: str, pair) -> None:
        hits = self.impl.get_computed_blocks(pair[0])
        assert hits == self.ref.get_computed_blocks(pair[1])
        blocks, num_hit = hits
        if self._allocate(req_id, pair, pair[0].num_tokens - num_hit, blocks):
            for r in pair:
                r.num_computed_tokens = num_hit
            self.running[req_id] = pair
            self.new_rows.add(req_id)

    def _free(self, req_id: str) -> tuple[Request, Request]:
        pair = self.running.pop(req_id)
        pending = {b for copy in self.expected_copies for b in copy}
        kept = [b for b in self.impl.get_block_ids(req_id) if b in pending]
        if kept:
            event("a freed request's blocks kept for a copy of the step")
        self.kept.update(kept)
        self.impl.free(pair[0])
        self.ref.free(pair[1])
        self.writes.pop(req_id, None)
        self.appended.pop(req_id, None)
        self.new_rows.discard(req_id)
        self.expected_refresh.discard(req_id)
        self.removed.add(req_id)
        return pair

    # -- rules ------------------------------------------------------------------------

    @precondition(lambda self: hasattr(self, "impl") and len(self.running) < 6)
    @rule(prompt=st.integers(0, len(PROMPTS) - 1), extra=st.integers(0, 3))
    def add(self, prompt: int, extra: int) -> None:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        tokens = PROMPTS[prompt] + [self._token() for _ in range(extra)]
        pair = tuple(Request(req_id, tokens, SamplingParams(max_tokens=50)) for _ in range(2))
        self._admit(req_id, pair)

    @precondition(lambda self: hasattr(self, "impl") and self.waiting
                  and len(self.running) < 6)
    @rule(index=st.integers(0, 9))
    def readmit(self, index: int) -> None:
        req_id = self._pick(self.waiting, index)
        self._admit(req_id, self.waiting[req_id])
        if req_id in self.running:
            del self.waiting[req_id]

    @precondition(lambda self: hasattr(self, "impl") and self.running and not self.writes
                  and not self.expected_copies and len(self.running) < 6)
    @rule(index=st.integers(0, 9), copies=st.integers(1, 3), diverge=st.booleans(),
          then_step=st.booleans())
    def fork(self, index: int, copies: int, diverge: bool, then_step: bool) -> None:
        """Between steps: children take the parent's blocks (each its own next token, maybe);
        often the next step follows at once, as it does in an engine."""
        parent_id = self._pick(self.running, index)
        for _ in range(min(copies, 6 - len(self.running))):
            self._fork(parent_id, diverge)
        if then_step:
            self.schedule_step(0)

    def _fork(self, parent_id: str, diverge: bool) -> None:
        parent = self.running[parent_id][0]
        n = parent.num_computed_tokens
        tokens = list(parent.all_token_ids)
        if diverge and len(tokens) > n:
            tokens[n] = self._token()  # the child's own sampled token
        child_id = f"r{self.next_id}"
        self.next_id += 1
        pair = tuple(Request(child_id, tokens, SamplingParams(max_tokens=50)) for _ in range(2))
        blocks = self.impl.get_block_ids(parent_id)
        counts = [self.impl_alloc.ref_count(b) for b in blocks]
        for kv, p, c in zip((self.impl, self.ref), self.running[parent_id], pair):
            c.num_computed_tokens = n
            kv.fork(p, c)
        assert self.impl.get_block_ids(child_id) == blocks
        assert [self.impl_alloc.ref_count(b) for b in blocks] == [k + 1 for k in counts]
        assert pair[0].block_hashes == pair[1].block_hashes
        self.running[child_id] = pair
        self.new_rows.add(child_id)
        event("fork")

    @precondition(lambda self: hasattr(self, "impl") and self.running)
    @rule(lookahead=st.sampled_from([0, 0, 1]))
    def schedule_step(self, lookahead: int) -> None:
        """A scheduler's step: every running request in order; short of blocks, preempt the
        most recently added one (itself last); then the forward.

        As the engine's scheduler, it never preempts a request that already has its slots
        for this step (allocated by an earlier rule of the step): its blocks may be cached
        under the hashes of tokens the forward has not written yet, and a scheduler
        preempts only from the tail, behind the request it is scheduling."""
        order = list(self.running)
        index = 0
        while index < len(order):
            req_id = order[index]
            r = self.running[req_id][0]
            if req_id in self.writes or r.num_computed_tokens == r.num_tokens:
                index += 1
                continue
            while not self._allocate(req_id, self.running[req_id],
                                     r.num_tokens - r.num_computed_tokens, lookahead=lookahead):
                # the tail's last request without slots this step (at worst this one)
                victim = next(v for v in reversed(order[index:]) if v not in self.writes)
                order.remove(victim)
                self.preempt_one(victim)
                if victim == req_id:
                    break
            index += 1
        self.forward()

    @precondition(lambda self: hasattr(self, "impl") and self.running)
    @rule(index=st.integers(0, 9), lookahead=st.sampled_from([0, 0, 0, 1, 3]))
    def decode(self, index: int, lookahead: int) -> None:
        ready = [i for i, (r, _) in self.running.items()
                 if i not in self.writes and r.num_computed_tokens < r.num_tokens]
        if ready:
            req_id = ready[index % len(ready)]
            r = self.running[req_id][0]
            self._allocate(req_id, self.running[req_id], r.num_tokens - r.num_computed_tokens,
                           lookahead=lookahead)

    def _idle(self) -> dict:
        """Running requests with nothing scheduled this step: the ones a scheduler preempts
        (the step's tail) or finishes (after a step). A request is never freed between
        its allocation and the forward that writes its tokens."""
        return {i: p for i, p in self.running.items() if i not in self.writes}

    @precondition(lambda self: hasattr(self, "impl") and self._idle())
    @rule(index=st.integers(0, 9))
    def preempt(self, index: int) -> None:
        self.preempt_one(self._pick(self._idle(), index))

    def preempt_one(self, req_id: str) -> None:
        pair = self._free(req_id)
        for r in pair:
            r.num_computed_tokens = 0
        self.waiting[req_id] = pair

    @precondition(lambda self: hasattr(self, "impl") and self._idle())
    @rule(index=st.integers(0, 9))
    def finish(self, index: int) -> None:
        self._free(self._pick(self._idle(), index))

    @precondition(lambda self: hasattr(self, "impl"))
    @rule()
    def forward(self) -> None:
        """Close the step: drain, update the worker's table, copy, write, sample, poison."""
        copies = self.impl.take_blocks_to_copy()
        assert copies == self.ref.take_blocks_to_copy()
        assert copies == self.expected_copies, "the copies are not exactly the COWs"
        refresh = self.impl.take_req_ids_to_refresh()
        assert refresh == self.ref.take_req_ids_to_refresh()
        assert set(refresh) == self.expected_refresh
        # The worker: drop rows, then new rows (whole lists), refreshed rows, appends.
        for req_id in self.removed:
            if self.tables.has_request(req_id):
                self.tables.remove_request(req_id)
        for req_id in self.running:
            if req_id in self.new_rows or req_id in refresh:
                if self.tables.has_request(req_id):
                    self.tables.remove_request(req_id)
                self.tables.add_request(req_id)
                self.tables.append_blocks(req_id, self.impl.get_block_ids(req_id))
            elif self.appended.get(req_id):
                self.tables.append_blocks(req_id, self.appended[req_id])
            assert self.tables.get_block_ids(req_id) == self.impl.get_block_ids(req_id)
        # The copies, all read before any is written (they are independent).
        dsts = [d for _, d in copies]
        assert len(set(dsts)) == len(dsts) and not set(dsts) & {s for s, _ in copies}
        saved = [list(self.cache[s]) for s, _ in copies]
        for (_, dst), data in zip(copies, saved):
            self.cache[dst] = data
        # The forward: each token's content at its slot, junk in the lookahead slots.
        for req_id, (start, end, end_la) in self.writes.items():
            r = self.running[req_id][0]
            slots = self.tables.slot_mapping([req_id], [start], [end_la - start]).tolist()
            for pos, slot in zip(range(start, end_la), slots):
                value = _content(r.all_token_ids, pos) if pos < end else ("draft", req_id)
                self.cache[slot // self.bs][slot % self.bs] = value
            for pair_req in self.running[req_id]:
                pair_req.num_computed_tokens = end
            token = self._token()
            for pair_req in self.running[req_id]:
                pair_req.append_output_token_ids(token)
        # Free blocks that no prefix hit can reach hold garbage: NaN.
        for b in self.impl_alloc.get_free_block_ids():
            if self.impl_alloc.get_block_hash(b) is None:
                self.cache[b] = [None] * self.bs
        self._open_step()
        self.check_contents()

    # -- invariants -------------------------------------------------------------------

    def check_contents(self) -> None:
        for req_id, (r, _) in self.running.items():
            blocks = self.impl.get_block_ids(req_id)
            for pos in range(r.num_computed_tokens):
                got = self.cache[blocks[pos // self.bs]][pos % self.bs]
                assert got == _content(r.all_token_ids, pos), (
                    f"{req_id} position {pos}: its slot holds {got}, not its own prefix")

    @invariant()
    def same_as_ref_and_counted(self) -> None:
        if not hasattr(self, "impl"):
            return
        for req_id in set(self.running) | set(self.waiting):
            assert self.impl.get_block_ids(req_id) == self.ref.get_block_ids(req_id)
        free = self.impl_alloc.get_free_block_ids()
        assert free == self.ref_alloc.get_free_block_ids()
        assert all(self.impl_alloc.get_block_hash(b) == self.ref_alloc.get_block_hash(b)
                   for b in range(self.num_blocks))
        holders = self._holders() + self.kept
        for b in range(self.num_blocks):
            count = self.impl_alloc.ref_count(b)
            assert count >= 0, f"block {b}: negative ref count {count}"
            assert count == holders[b], f"block {b}: ref count {count}, holders {holders[b]}"
        assert len(set(free)) == len(free) and not set(free) & set(holders), "held block free"
        assert len(free) + len(holders) == self.num_blocks, "a block leaked"


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = stateful_settings(max_examples=150, step_count=40)
