"""Block tables under test (``backend.get("block_table")``) against a plain-Python oracle.

Random tables are built by a random sequence of add / append / remove (so
rows get recycled), with awkward block sizes from 1 to 32; then the block
table tensor and the slot mapping of a random step, with chunk starts and
ends drawn near block boundaries, are checked against the formula
``slot = block_ids[pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm import backend


def _impl():
    return backend.get("block_table").BlockTables


def _near_boundary(draw, block_size: int, limit: int) -> int:
    """A position in [0, limit], often a multiple of block_size or one off it."""
    if limit == 0:
        return 0
    kind = draw(st.sampled_from(["any", "boundary"]))
    if kind == "any":
        return draw(st.integers(0, limit))
    b = draw(st.integers(0, limit // block_size)) * block_size
    return min(limit, max(0, b + draw(st.integers(-1, 1))))


@given(data=st.data(), block_size=st.integers(1, 32), max_blocks=st.integers(1, 9))
def test_random_tables_and_slot_mapping(data, block_size: int, max_blocks: int) -> None:
    max_reqs = data.draw(st.integers(1, 6))
    tables = _impl()(max_reqs, max_blocks, block_size)
    oracle: dict[str, list[int]] = {}
    next_id = 0
    num_pool_blocks = 64
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["add", "append", "append", "remove"]))
        if op == "add" and len(oracle) < max_reqs:
            req_id = f"r{next_id}"
            next_id += 1
            tables.add_request(req_id)
            oracle[req_id] = []
        elif op == "append" and oracle:
            req_id = data.draw(st.sampled_from(sorted(oracle)))
            room = max_blocks - len(oracle[req_id])
            new = data.draw(st.lists(st.integers(0, num_pool_blocks - 1), max_size=room))
            tables.append_blocks(req_id, new)
            oracle[req_id].extend(new)
        elif op == "remove" and oracle:
            req_id = data.draw(st.sampled_from(sorted(oracle)))
            tables.remove_request(req_id)
            del oracle[req_id]

    for req_id, blocks in oracle.items():
        assert tables.get_block_ids(req_id) == blocks

    # A step over a random subset of the requests, in a random order.
    req_ids = data.draw(st.permutations(sorted(oracle))) if oracle else []
    req_ids = req_ids[: data.draw(st.integers(0, len(req_ids)))]
    expected_table = torch.zeros(len(req_ids), max_blocks, dtype=torch.int32)
    for i, req_id in enumerate(req_ids):
        expected_table[i, : len(oracle[req_id])] = torch.tensor(oracle[req_id], dtype=torch.int32)
    got_table = tables.block_table_tensor(req_ids)
    assert got_table.dtype == torch.int32
    assert torch.equal(got_table, expected_table)

    starts, counts, expected_slots = [], [], []
    for req_id in req_ids:
        capacity = len(oracle[req_id]) * block_size
        start = _near_boundary(data.draw, block_size, capacity)
        end = _near_boundary(data.draw, block_size, capacity)
        start, end = min(start, end), max(start, end)
        starts.append(start)
        counts.append(end - start)
        for pos in range(start, end):
            expected_slots.append(
                oracle[req_id][pos // block_size] * block_size + pos % block_size
            )
    got = tables.slot_mapping(req_ids, starts, counts)
    assert got.dtype == torch.int64 and got.shape == (sum(counts),)
    assert got.tolist() == expected_slots

    # A decode step: one token per request (the fast twin's own short path).
    decoding = [r for r in req_ids if oracle[r]]
    positions = [data.draw(st.integers(0, len(oracle[r]) * block_size - 1)) for r in decoding]
    got = tables.slot_mapping(decoding, positions, [1] * len(decoding))
    assert got.dtype == torch.int64 and got.shape == (len(decoding),)
    assert got.tolist() == [oracle[r][p // block_size] * block_size + p % block_size
                            for r, p in zip(decoding, positions)]


def test_unused_entries_are_zero_after_row_reuse() -> None:
    tables = _impl()(1, 4, 2)
    tables.add_request("a")
    tables.append_blocks("a", [7, 8, 9])
    tables.remove_request("a")
    tables.add_request("b")  # gets the recycled row
    tables.append_blocks("b", [5])
    assert tables.block_table_tensor(["b"]).tolist() == [[5, 0, 0, 0]]
    assert tables.slot_mapping(["b"], [1], [1]).tolist() == [5 * 2 + 1]


def test_incremental_appends() -> None:
    tables = _impl()(2, 5, 3)
    tables.add_request("x")
    tables.add_request("y")
    tables.append_blocks("x", [4])
    tables.append_blocks("y", [1, 2])
    tables.append_blocks("x", [0, 3])
    assert tables.get_block_ids("x") == [4, 0, 3]
    # Position 3 is the first token of logical block 1 (physical block 0).
    assert tables.slot_mapping(["y", "x"], [2, 2], [2, 3]).tolist() == [
        1 * 3 + 2, 2 * 3 + 0, 4 * 3 + 2, 0 * 3 + 0, 0 * 3 + 1
    ]


def test_bad_input() -> None:
    tables = _impl()(1, 2, 4)
    tables.add_request("a")
    with pytest.raises(ValueError, match="already"):
        tables.add_request("a")
    with pytest.raises(ValueError, match="max_num_reqs"):
        tables.add_request("b")
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        tables.append_blocks("a", [1, 2, 3])
    with pytest.raises(ValueError, match="no block table"):
        tables.get_block_ids("zzz")
    tables.append_blocks("a", [1])
    with pytest.raises(ValueError, match="positions"):
        tables.slot_mapping(["a"], [2], [3])  # runs past its only block
    with pytest.raises(ValueError, match="block_size"):
        _impl()(1, 2, 0)
