"""``copy_blocks`` (the copies of copy-on-write) against an oracle and the ref.

Each implementation (``--backend=fast`` on a CPU runs the C++ op and the Triton
kernel in the interpreter) copies every layer's K and V block ``src -> dst``
for a step's pairs. Checked bit for bit against a plain Python loop over
clones, on awkward shapes: block sizes that are not powers of 2, GQA head
counts, several layers, sources that repeat (siblings copying one shared
block), caches that are views with a block stride of their own (K and V
interleaved in one tensor), an empty mapping. Every block that is not a
destination must come out untouched. Bad input raises ``ValueError`` naming
the argument.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import (
    DEVICE,
    DTYPES,
    examples,
    kernel_backend,  # noqa: F401  (runs every test per kernel backend)
)

from minivllm import backend
from minivllm.ref import cache_write as ref_cache_write
from minivllm.testing.strategies import SMALL_HEAD_DIMS, gqa_heads


def _caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed,
            interleaved=False):
    """Random per-layer (K, V) caches; ``interleaved``: K and V views of one tensor."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    layers = []
    for _ in range(num_layers):
        if interleaved:  # (num_blocks, 2, ...): each block stride is twice a block
            kv = torch.randn(num_blocks, 2, *shape[1:], generator=g).to(dtype)
            layers.append((kv[:, 0], kv[:, 1]))
        else:
            layers.append((torch.randn(shape, generator=g).to(dtype),
                           torch.randn(shape, generator=g).to(dtype)))
    return layers


def _oracle(kv_caches, pairs):
    """A plain Python loop over clones: block dst of every tensor becomes block src."""
    out = [(k.clone(), v.clone()) for k, v in kv_caches]
    for src, dst in pairs:
        for (k, v), (k0, v0) in zip(out, kv_caches):
            k[dst], v[dst] = k0[src], v0[src]
    return out


def _mapping(draw_pairs, num_blocks):
    """Distinct destinations, none of them a source; sources drawn with repeats."""
    srcs, num_dsts = draw_pairs
    srcs = [s % num_blocks for s in srcs]
    dsts = [b for b in range(num_blocks) if b not in srcs][:num_dsts]
    return list(zip(srcs, dsts))


def _run(kv_caches, pairs):
    dev = [(k.to(DEVICE), v.to(DEVICE)) for k, v in kv_caches]
    mapping = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    backend.get("cache_write").copy_blocks(dev, mapping)
    return [(k.cpu(), v.cpu()) for k, v in dev]


@settings(max_examples=examples(20))
@given(
    num_layers=st.integers(1, 3),
    block_size=st.sampled_from([1, 3, 5, 16]),
    heads=gqa_heads(3),
    head_dim=st.sampled_from(SMALL_HEAD_DIMS),
    extra_blocks=st.integers(0, 4),
    pairs=st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=5), st.integers(0, 5)),
    dtype=st.sampled_from(DTYPES),
    interleaved=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_copy_blocks_matches_oracle(num_layers, block_size, heads, head_dim, extra_blocks,
                                    pairs, dtype, interleaved, seed):
    num_blocks = 3 + extra_blocks
    kv_caches = _caches(num_layers, num_blocks, block_size, heads[1], head_dim, dtype, seed,
                        interleaved)
    mapping = _mapping(pairs, num_blocks)
    got = _run(kv_caches, mapping)
    expected = _oracle(kv_caches, mapping)
    for (k, v), (ek, ev) in zip(got, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    if backend.get("cache_write") is not ref_cache_write:
        ref = [(k.clone(), v.clone()) for k, v in kv_caches]
        ref_cache_write.copy_blocks(ref, torch.tensor(mapping, dtype=torch.int64).reshape(-1, 2))
        for (k, v), (rk, rv) in zip(got, ref):
            assert torch.equal(k, rk) and torch.equal(v, rv)


def test_one_source_to_many_and_nothing_else_moves():
    """Three siblings copy one shared block (parallel sampling, n=4); NaN elsewhere stays."""
    kv_caches = _caches(2, 9, 5, 2, 24, torch.float32, 0)
    for k, v in kv_caches:
        k[5:], v[5:] = float("nan"), float("nan")  # the free blocks: poisoned
    got = _run(kv_caches, [(2, 5), (2, 7), (2, 8)])
    for (k, v), (k0, v0) in zip(got, kv_caches):
        for dst in (5, 7, 8):
            assert torch.equal(k[dst], k0[2]) and torch.equal(v[dst], v0[2])
        assert torch.isnan(k[6]).all() and torch.isnan(v[6]).all()  # not a destination
        assert torch.equal(k[:5], k0[:5]) and torch.equal(v[:5], v0[:5])


def test_empty_mapping_changes_nothing():
    kv_caches = _caches(2, 4, 3, 1, 8, torch.float16, 1)
    got = _run(kv_caches, [])
    for (k, v), (k0, v0) in zip(got, kv_caches):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("pairs, field", [
    ([[0, 9]], "block_mapping"),  # dst outside the 4 blocks
    ([[0, 1], [2, 1]], "block_mapping"),  # one destination twice
    ([[0, 1], [1, 2]], "block_mapping"),  # a destination that is also a source
    ([0, 1], "block_mapping"),  # not (num_pairs, 2)
])
def test_bad_mapping_is_a_value_error(pairs, field):
    kv_caches = [(k.to(DEVICE), v.to(DEVICE)) for k, v in _caches(1, 4, 2, 1, 8, torch.float32, 0)]
    with pytest.raises(ValueError, match=field):
        backend.get("cache_write").copy_blocks(kv_caches, torch.tensor(pairs))


def test_bad_caches_are_a_value_error():
    impl = backend.get("cache_write")
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="kv_caches"):
        impl.copy_blocks([], mapping)
    layers = _caches(2, 4, 2, 1, 8, torch.float32, 0)
    layers[1] = (layers[1][0][:, :1].contiguous(), layers[1][1])  # layer 1: block_size 1
    with pytest.raises(ValueError, match="kv_caches"):
        impl.copy_blocks([(k.to(DEVICE), v.to(DEVICE)) for k, v in layers], mapping)
