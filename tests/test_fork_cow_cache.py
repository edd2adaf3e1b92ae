"""Fork and copy-on-write with real KV tensors: free blocks poisoned with NaN.

The components under test (``backend.get``: KV cache manager, block allocator,
block table, ``cache_write``; under ``--backend=fast`` on a CPU also the Triton
kernels in the interpreter) serve a parallel-sampling group or a beam group,
as the engine will: the parent's prompt is prefilled once, children fork its
blocks, every step drains the copies (``copy_blocks`` before the writes) and
the rows to refresh, writes each new token's K/V with ``reshape_and_cache``
through the slot mapping, and samples a token per sequence. Beams are dropped
(their blocks freed at once) and surviving beams branch. After every step,
every free block that no prefix hit can reach is poisoned with NaN in every
layer, and every live sequence's computed slots must hold exactly the K/V of
its own prefix, without a NaN: a block shared and written, a copy missed,
reversed or run after the writes, or a block freed while still shared, shows.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import (
    examples,
    kernel_backend,  # noqa: F401  (runs every test per kernel backend)
)

from minivllm import SamplingParams, backend
from minivllm.config import cdiv
from minivllm.request import Request

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 6

# Under minivllm.fast.triton (the kernels in the interpreter) the host side comes from the ref.
pytestmark = pytest.mark.filterwarnings("ignore:minivllm.*has no submodule or attribute")


def _kv(tokens: list[int], pos: int, layer: int) -> torch.Tensor:
    """The (H_kv, D) key of position ``pos``: a function of the whole prefix (V is -K)."""
    base = float(hash(tuple(tokens[: pos + 1])) % 1009 + 1) * (layer + 1)
    return base + 0.01 * torch.arange(NUM_KV_HEADS * HEAD_DIM).view(NUM_KV_HEADS, HEAD_DIM)


class Group:
    """Sequences sharing blocks through the components under test, one engine step at a time.

    ``manager_only``: the KV cache manager under test, every other part the ref's.
    """

    def __init__(self, block_size: int, num_blocks: int, caching: bool,
                 manager_only: bool = False) -> None:
        def part(name: str):
            return importlib.import_module(f"minivllm.ref.{name}") if manager_only else \
                backend.get(name)

        alloc = part("block_allocator").BlockAllocator(num_blocks, block_size, caching)
        self.alloc, self.bs = alloc, block_size
        self.kv = backend.get("kv_cache_manager").KVCacheManager(alloc)
        self.tables = part("block_table").BlockTables(32, num_blocks, block_size)
        self.cache_write = part("cache_write")
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        self.kv_caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                          for _ in range(NUM_LAYERS)]
        self.live: dict[str, Request] = {}
        self.new_rows: set[str] = set()
        self.num_copies = 0

    def add(self, req_id: str, prompt: list[int]) -> Request:
        r = Request(req_id, prompt, SamplingParams(max_tokens=100))
        self.live[req_id] = r
        self.new_rows.add(req_id)
        return r

    def fork(self, parent: Request, child_id: str, token: int) -> Request:
        """A child with the parent's computed tokens and its own next token."""
        child = Request(child_id, parent.all_token_ids[: parent.num_computed_tokens],
                        SamplingParams(max_tokens=100))
        child.num_computed_tokens = parent.num_computed_tokens
        child.append_output_token_ids(token)
        self.kv.fork(parent, child)
        self.live[child_id] = child
        self.new_rows.add(child_id)
        return child

    def drop(self, req_id: str) -> None:
        """A beam that did not survive: its blocks go back at once."""
        self.kv.free(self.live.pop(req_id))
        self.new_rows.discard(req_id)
        if self.tables.has_request(req_id):  # a child forked after the last step has none
            self.tables.remove_request(req_id)

    def step(self, rng: random.Random) -> None:
        ids = list(self.live)
        starts = [self.live[i].num_computed_tokens for i in ids]
        counts = [self.live[i].num_tokens - s for i, s in zip(ids, starts)]
        appended = {i: self.kv.allocate_slots(self.live[i], n) for i, n in zip(ids, counts)}
        assert all(v is not None for v in appended.values()), "the pool is sized to fit"
        copies = self.kv.take_blocks_to_copy()
        refresh = set(self.kv.take_req_ids_to_refresh())
        self.num_copies += len(copies)
        for i in ids:  # the worker: new and refreshed rows get the whole list
            if i in self.new_rows or i in refresh:
                if self.tables.has_request(i):
                    self.tables.remove_request(i)
                self.tables.add_request(i)
                self.tables.append_blocks(i, self.kv.get_block_ids(i))
            else:
                self.tables.append_blocks(i, appended[i])
        self.new_rows.clear()
        if copies:  # before the forward writes the cache
            mapping = torch.tensor(copies, dtype=torch.int64)  # (num_pairs, 2)
            self.cache_write.copy_blocks(self.kv_caches, mapping)
        slots = self.tables.slot_mapping(ids, starts, counts)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            key = torch.stack([_kv(self.live[i].all_token_ids, p, layer)
                               for i, s, n in zip(ids, starts, counts) for p in range(s, s + n)])
            self.cache_write.reshape_and_cache(key, -key, k_cache, v_cache, slots)
        for i, s, n in zip(ids, starts, counts):
            self.live[i].num_computed_tokens = s + n
            self.live[i].append_output_token_ids(rng.randrange(1000, 2000))
        self.poison_free_blocks()
        self.check()

    def poison_free_blocks(self) -> None:
        for b in self.alloc.get_free_block_ids():
            if self.alloc.get_block_hash(b) is None:  # a cached free block may still be hit
                for k_cache, v_cache in self.kv_caches:
                    k_cache[b], v_cache[b] = float("nan"), float("nan")

    def check(self) -> None:
        for req_id, r in self.live.items():
            blocks = self.kv.get_block_ids(req_id)
            for pos in range(r.num_computed_tokens):
                block, offset = blocks[pos // self.bs], pos % self.bs
                assert self.alloc.ref_count(block) >= 1, f"{req_id} reads free block {block}"
                for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                    k, v = k_cache[block, offset], v_cache[block, offset]
                    assert not (k.isnan().any() or v.isnan().any()), (
                        f"{req_id} position {pos} (block {block}) holds NaN in layer {layer}")
                    expected = _kv(r.all_token_ids, pos, layer)
                    assert torch.equal(k, expected) and torch.equal(v, -expected), (
                        f"{req_id} position {pos} (block {block}): another sequence's K/V")


def _run_group(block_size, prompt_len, width, steps, beam, caching, seed, manager_only):
    rng = random.Random(seed)
    # Room for every sequence without sharing, plus copies in flight: never short.
    num_blocks = (width + 2) * cdiv(prompt_len + steps + 2, block_size) + width
    group = Group(block_size, num_blocks, caching, manager_only)
    parent = group.add("p", [rng.randrange(1, 999) for _ in range(prompt_len)])
    group.step(rng)  # the prompt, prefilled once; the parent samples its first token
    for i in range(1, width):  # parallel sampling: width - 1 children, each its own token
        group.fork(parent, f"c{i}", rng.randrange(1000, 2000))
    next_id = width
    for _ in range(steps):
        group.step(rng)
        if beam and len(group.live) > 1:
            # Beam search: the worst beam is dropped, a survivor branches in its place.
            group.drop(rng.choice(sorted(group.live)))
            survivor = group.live[rng.choice(sorted(group.live))]
            group.fork(survivor, f"c{next_id}", rng.randrange(1000, 2000))
            next_id += 1
    if prompt_len % block_size and width > 1:
        assert group.num_copies >= 1, "a partial prompt block shared by a group is copied"
    for r in list(group.live.values()):
        group.drop(r.request_id)
    assert group.alloc.num_free_blocks == num_blocks


groups = dict(
    block_size=st.sampled_from([2, 3, 5]),
    prompt_len=st.integers(1, 11),
    width=st.integers(2, 4),
    steps=st.integers(1, 7),
    beam=st.booleans(),
    caching=st.booleans(),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=examples(12), deadline=None)
@given(**groups)
def test_shared_blocks_never_hold_nan_or_a_siblings_kv(block_size, prompt_len, width, steps,
                                                       beam, caching, seed):
    _run_group(block_size, prompt_len, width, steps, beam, caching, seed, manager_only=False)


@settings(max_examples=examples(12), deadline=None)
@given(**groups)
def test_the_manager_alone_keeps_every_sequence_intact(block_size, prompt_len, width, steps,
                                                       beam, caching, seed):
    """The same, with every part but the KV cache manager the ref's (course task 19)."""
    _run_group(block_size, prompt_len, width, steps, beam, caching, seed, manager_only=True)
