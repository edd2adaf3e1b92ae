"""Chained block hashes (``minivllm.prefix_hash``) against the documented formula.

The oracle is written here from the module docstring: SHA-256 of the parent
hash and the token ids, each as an unsigned 64-bit *little-endian* integer,
first 8 bytes of the digest read little-endian. The fixed vectors pin those
bytes: an implementation hashing in the machine's native byte order gives
other values on a big-endian host, and any change to the encoding changes
them everywhere (every cached prefix would be renamed).
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.prefix_hash import NONE_HASH, hash_block_tokens, hash_request_tokens


def oracle(parent: int | None, token_ids: list[int]) -> int:
    """The formula, byte by byte."""
    parent = NONE_HASH if parent is None else parent
    data = b"".join(x.to_bytes(8, "little") for x in [parent, *token_ids])
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def test_fixed_vectors() -> None:
    assert NONE_HASH == int.from_bytes(
        hashlib.sha256(b"minivllm-prefix-cache").digest()[:8], "little")
    assert NONE_HASH == 5461669465715282247
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == oracle(None, [1, 2, 3, 4]) == 17162032666615194995
    # A token id above 32 bits: the full 64-bit width is hashed.
    h1 = hash_block_tokens(h0, [5, 6, 7, 2**40])
    assert h1 == oracle(h0, [5, 6, 7, 2**40]) == 67017576822780652
    assert hash_request_tokens(4, [1, 2, 3, 4, 5, 6, 7, 2**40, 9]) == [h0, h1]


def test_byte_order_is_little_endian() -> None:
    tokens = [1, 258, 2**33 + 7]
    big = b"".join(x.to_bytes(8, "big") for x in [NONE_HASH, *tokens])
    native_on_big_endian = int.from_bytes(hashlib.sha256(big).digest()[:8], "little")
    assert hash_block_tokens(None, tokens) == oracle(None, tokens)
    assert hash_block_tokens(None, tokens) != native_on_big_endian


def test_chain_names_the_whole_prefix() -> None:
    block = [7, 7, 7, 7]
    a, b = hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(None, [1, 2, 3, 5])
    # The same tokens under different parents are different blocks of K/V.
    assert len({hash_block_tokens(a, block), hash_block_tokens(b, block),
                hash_block_tokens(None, block)}) == 3
    # None means "first block": the documented seed, not 0.
    assert hash_block_tokens(None, block) == hash_block_tokens(NONE_HASH, block)
    assert hash_block_tokens(None, block) != hash_block_tokens(0, block)
    # Order within a block matters, and so does the block's length.
    assert hash_block_tokens(a, [1, 2]) != hash_block_tokens(a, [2, 1])
    assert hash_block_tokens(a, [1, 2]) != hash_block_tokens(a, [1, 2, 0])


@given(tokens=st.lists(st.integers(0, 2**64 - 1), max_size=40), block_size=st.integers(1, 9))
def test_request_hashes_fold_the_block_hashes(tokens: list[int], block_size: int) -> None:
    expected, parent = [], None
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = oracle(parent, tokens[start : start + block_size])
        expected.append(parent)
    got = hash_request_tokens(block_size, tokens)
    assert got == expected  # full blocks only: a partial tail is not hashed
    assert len(got) == len(tokens) // block_size


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens(0, [1, 2])
