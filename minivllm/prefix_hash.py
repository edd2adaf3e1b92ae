"""Chained block hashes for automatic prefix caching.

A *full* KV block holds the keys and values of ``block_size`` tokens, and
those depend on every token before them, not only on the block's own tokens.
So a block is named by a **chained hash**: the hash of its parent block's hash
together with its own token ids::

    h0 = hash_block_tokens(None, tokens[0:16])
    h1 = hash_block_tokens(h0,   tokens[16:32])
    h2 = hash_block_tokens(h1,   tokens[32:48])   # names tokens[0:48], not just [32:48]

Two requests whose prompts start with the same 48 tokens get the same
``h0, h1, h2`` and can share those three blocks. Only full blocks are hashed:
a partly filled block will still change.

The hashes must be the same in every process (the engine may restart, tensor-
parallel ranks must agree), so Python's ``hash()`` of a ``str`` (salted per
process) is out; we take the first 8 bytes of a SHA-256 digest, as vLLM's
``sha256`` prefix-caching option does. The bytes hashed are fixed too: the
parent hash and each token id as an unsigned 64-bit *little-endian* integer,
whatever the machine's native byte order. Both twins of the block allocator and of
the scheduler use this module, so they always agree on names.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: The "parent hash" of a request's first block: a fixed, documented seed.
NONE_HASH: int = int.from_bytes(hashlib.sha256(b"minivllm-prefix-cache").digest()[:8], "little")


def hash_block_tokens(parent_block_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chained hash of one full block: ``sha256(parent_hash, *token_ids)``, 64 bits.

    Args:
        parent_block_hash: hash of the previous block of the same sequence, or
            None for the first block.
        token_ids: the block's token ids (non-negative ints).
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    # '<' = little-endian, 'Q' = unsigned 64-bit: the same bytes on every machine
    # (a plain array("Q") would use the host's native byte order).
    payload = struct.pack(f"<{1 + len(token_ids)}Q", parent, *token_ids)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def hash_request_tokens(block_size: int, token_ids: Sequence[int]) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (a partial tail is skipped).

    ``len(result) == len(token_ids) // block_size``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
