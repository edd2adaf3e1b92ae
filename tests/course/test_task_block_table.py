"""Course task: block tables and slot mapping, against the formula written out by hand."""

from __future__ import annotations

import torch

from minivllm import backend


def test_slot_mapping_for_chunks_that_start_and_end_mid_block():
    tables = backend.get("block_table").BlockTables(3, 4, 4)
    tables.add_request("a")
    tables.add_request("b")
    tables.append_blocks("a", [7, 2])
    tables.append_blocks("b", [5])
    tables.append_blocks("a", [9])  # grows later, like a request that decodes past a block
    got = tables.slot_mapping(["a", "b"], [3, 1], [6, 2]).tolist()
    # a: positions 3..8 -> blocks 7 (pos 3), 2 (pos 4-7), 9 (pos 8); b: positions 1, 2 in block 5.
    expected = [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    assert got == expected, f"slot mapping {got}, expected {expected}"
    table = tables.block_table_tensor(["b", "a"])
    assert table.dtype == torch.int32
    assert table.tolist() == [[5, 0, 0, 0], [7, 2, 9, 0]], "rows in the order asked, zero-padded"


def test_a_reused_row_does_not_keep_old_blocks():
    tables = backend.get("block_table").BlockTables(1, 3, 2)
    tables.add_request("a")
    tables.append_blocks("a", [4, 5, 6])
    tables.remove_request("a")
    tables.add_request("b")
    tables.append_blocks("b", [1])
    assert tables.block_table_tensor(["b"]).tolist() == [[1, 0, 0]]
    assert tables.slot_mapping(["b"], [0], [2]).tolist() == [2, 3]
