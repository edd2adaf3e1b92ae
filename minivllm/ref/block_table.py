"""Block tables and slot mapping: from a token's position to its KV cache slot.

A request's KV cache is not contiguous. Its *block table* lists the physical
blocks it owns, in order: logical block ``i`` (tokens ``i * block_size`` to
``(i + 1) * block_size - 1``) lives in physical block ``block_ids[i]``. So the
token at position ``pos`` has its K/V at

    slot = block_ids[pos // block_size] * block_size + pos % block_size

in the cache viewed as one flat array of ``num_blocks * block_size`` slots.
Each step the model runner needs two tensors from here:

- ``block_table_tensor``: ``(num_reqs, max_num_blocks_per_req)`` int32, one
  padded row per scheduled request, read by the attention kernel to find the
  context's K/V;
- ``slot_mapping``: ``(num_tokens,)`` int64, where each *new* token's K/V is
  written (:mod:`minivllm.ref.cache_write`).

Who owns the table: the worker, on every rank (:mod:`minivllm.worker.worker`),
beside that rank's KV cache (in vLLM v1 the GPU model runner inside the
worker holds it, in its input batch). The
scheduler decides which blocks a request gets and sends only the changes each
step (``SchedulerOutput.new_block_ids``, plus the finished and preempted
requests, whose rows are dropped); each worker applies them here, and builds
the two tensors on its own device.

This reference twin keeps a dict of Python lists and builds both tensors with
plain Python, a row and a token at a time, which is easy to check by eye.
:mod:`minivllm.fast.block_table` keeps a preallocated tensor and vectorises.
"""

from __future__ import annotations

import torch

__all__ = ["BlockTables"]


class BlockTables:
    """The block tables of every running request (one worker's copy).

    Args:
        max_num_reqs: most requests held at once (the scheduler's ``max_num_seqs``).
        max_num_blocks_per_req: longest table, ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        device: where the returned tensors live.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        for name, value in [
            ("max_num_reqs", max_num_reqs),
            ("max_num_blocks_per_req", max_num_blocks_per_req),
            ("block_size", block_size),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_size = block_size
        self.device = torch.device(device)
        # request id -> its physical block ids, logical block 0 first.
        self.block_ids: dict[str, list[int]] = {}

    def add_request(self, req_id: str) -> None:
        """Give ``req_id`` an empty block table."""
        if req_id in self.block_ids:
            raise ValueError(f"req_id {req_id!r} already has a block table")
        if len(self.block_ids) >= self.max_num_reqs:
            raise ValueError(f"cannot add {req_id!r}: max_num_reqs={self.max_num_reqs} reached")
        self.block_ids[req_id] = []

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        """Append physical blocks to the end of ``req_id``'s table."""
        # BEGIN SOLUTION
        table = self._table(req_id)
        if len(table) + len(block_ids) > self.max_num_blocks_per_req:
            raise ValueError(
                f"request {req_id!r} would have {len(table) + len(block_ids)} blocks; "
                f"max_num_blocks_per_req is {self.max_num_blocks_per_req}"
            )
        table.extend(block_ids)
        # END SOLUTION

    def remove_request(self, req_id: str) -> None:
        """Drop ``req_id``'s table (its blocks are freed by the allocator, not here)."""
        self._table(req_id)
        del self.block_ids[req_id]

    def has_request(self, req_id: str) -> bool:
        """True if ``req_id`` has a block table."""
        return req_id in self.block_ids

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of ``req_id``'s physical block ids, in logical order."""
        return list(self._table(req_id))

    def block_table_tensor(self, req_ids: list[str]) -> torch.Tensor:
        """``(len(req_ids), max_num_blocks_per_req)`` int32 tables, unused entries 0."""
        # BEGIN SOLUTION
        rows = []
        for req_id in req_ids:
            table = self._table(req_id)
            rows.append(table + [0] * (self.max_num_blocks_per_req - len(table)))
        if not rows:
            shape = (0, self.max_num_blocks_per_req)
            return torch.zeros(shape, dtype=torch.int32, device=self.device)
        return torch.tensor(rows, dtype=torch.int32, device=self.device)
        # END SOLUTION

    def slot_mapping(
        self, req_ids: list[str], start_positions: list[int], num_tokens: list[int]
    ) -> torch.Tensor:
        """``(sum(num_tokens),)`` int64 cache slots of the tokens computed this step.

        Request ``i`` computes positions ``start_positions[i] ..
        start_positions[i] + num_tokens[i] - 1``; its slots come in that order,
        after those of request ``i - 1``.
        """
        # BEGIN SOLUTION
        bs = self.block_size
        slots: list[int] = []
        for req_id, start, n in zip(req_ids, start_positions, num_tokens, strict=True):
            table = self._table(req_id)
            self._check_positions(req_id, start, n, len(table))
            for pos in range(start, start + n):
                slots.append(table[pos // bs] * bs + pos % bs)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)
        # END SOLUTION

    def _table(self, req_id: str) -> list[int]:
        table = self.block_ids.get(req_id)
        if table is None:
            raise ValueError(f"req_id {req_id!r} has no block table")
        return table

    def _check_positions(self, req_id: str, start: int, n: int, num_blocks: int) -> None:
        if start < 0 or n < 0 or start + n > num_blocks * self.block_size:
            raise ValueError(
                f"positions [{start}, {start + n}) of request {req_id!r} must lie in "
                f"[0, {num_blocks * self.block_size}) (its {num_blocks} blocks)"
            )
