"""Block tables in one preallocated tensor, slot mapping vectorised (twin of the ref).

Read :mod:`minivllm.ref.block_table` first for what a block table and a slot
mapping are. Same results; what is different, and why it is faster:

- The tables live in one preallocated ``(max_num_reqs, max_num_blocks_per_req)``
  int32 tensor, a row per request. Rows are recycled through a free list, so
  nothing is allocated per request, and :meth:`append_blocks` writes only the
  new entries (through a numpy view of the CPU tensor: a few microseconds).
- :meth:`block_table_tensor` is one ``index_select`` of the scheduled rows,
  not a Python list of padded lists converted element by element.
- :meth:`slot_mapping` has no per-token Python loop: positions are built with
  ``arange`` / ``cumsum`` arithmetic and the block ids gathered from
  the table in one ``index_select``, on the target device.

On a GPU the CPU tensor is the master copy (cheap to write from Python) and a
device copy is refreshed, for the rows changed since the last use only,
before a step reads it. vLLM v1's ``BlockTable`` works the same way.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BlockTables"]


class BlockTables:
    """The block tables of every running request (one worker's copy).

    Args:
        max_num_reqs: most requests held at once (the scheduler's ``max_num_seqs``).
        max_num_blocks_per_req: longest table, ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        device: where the returned tensors live (and where they are computed).
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
        on_cpu = self.device.type == "cpu"
        shape = (max_num_reqs, max_num_blocks_per_req)
        # Master copy on the host; pinned so copies to a GPU can be asynchronous.
        self._table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=not on_cpu)
        self._table_np = self._table_cpu.numpy()  # shares memory: fast scalar/slice writes
        self._table_dev = self._table_cpu if on_cpu else self._table_cpu.to(self.device)
        self._dirty_rows: set[int] = set()  # rows whose device copy is stale
        self._row_of: dict[str, int] = {}  # request id -> row
        self._num_blocks = [0] * max_num_reqs  # used entries of each row
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives row 0 first

    def add_request(self, req_id: str) -> None:
        """Give ``req_id`` an empty block table (a recycled row)."""
        if req_id in self._row_of:
            raise ValueError(f"req_id {req_id!r} already has a block table")
        if not self._free_rows:
            raise ValueError(f"cannot add {req_id!r}: max_num_reqs={self.max_num_reqs} reached")
        self._row_of[req_id] = self._free_rows.pop()

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        """Append physical blocks to the end of ``req_id``'s table (writes only those)."""
        row = self._row(req_id)
        start = self._num_blocks[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"request {req_id!r} would have {end} blocks; "
                f"max_num_blocks_per_req is {self.max_num_blocks_per_req}"
            )
        if block_ids:
            self._table_np[row, start:end] = block_ids
            self._num_blocks[row] = end
            self._dirty_rows.add(row)

    def remove_request(self, req_id: str) -> None:
        """Drop ``req_id``'s table and recycle its row (zeroed: unused entries are 0)."""
        row = self._row(req_id)
        self._table_np[row, : self._num_blocks[row]] = 0
        self._num_blocks[row] = 0
        self._dirty_rows.add(row)
        del self._row_of[req_id]
        self._free_rows.append(row)

    def has_request(self, req_id: str) -> bool:
        """True if ``req_id`` has a block table."""
        return req_id in self._row_of

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of ``req_id``'s physical block ids, in logical order."""
        row = self._row(req_id)
        return self._table_np[row, : self._num_blocks[row]].tolist()

    def block_table_tensor(self, req_ids: list[str]) -> torch.Tensor:
        """``(len(req_ids), max_num_blocks_per_req)`` int32 tables, unused entries 0."""
        rows = [self._row(r) for r in req_ids]
        if self._table_dev is self._table_cpu:
            # numpy's row gather: one serial copy (torch's may spin up a thread pool).
            return torch.from_numpy(self._table_np[rows])
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return torch.index_select(self._device_table(), 0, rows_t)

    def slot_mapping(
        self, req_ids: list[str], start_positions: list[int], num_tokens: list[int]
    ) -> torch.Tensor:
        """``(sum(num_tokens),)`` int64 cache slots of the tokens computed this step.

        Request ``i`` computes positions ``start_positions[i] ..
        start_positions[i] + num_tokens[i] - 1``; its slots come in that order,
        after those of request ``i - 1``.
        """
        if not len(req_ids) == len(start_positions) == len(num_tokens):
            raise ValueError("req_ids, start_positions and num_tokens must have the same length")
        rows = [self._row(r) for r in req_ids]
        bs = self.block_size
        for req_id, row, start, n in zip(req_ids, rows, start_positions, num_tokens):
            if start < 0 or n < 0 or start + n > self._num_blocks[row] * bs:
                raise ValueError(
                    f"positions [{start}, {start + n}) of request {req_id!r} must lie in "
                    f"[0, {self._num_blocks[row] * bs}) (its {self._num_blocks[row]} blocks)"
                )
        total = sum(num_tokens)
        decode = bool(rows) and total == len(rows) and max(num_tokens) == 1  # 1 token each
        if decode and self._table_dev is self._table_cpu:
            # A decode step: one numpy gather, table[row, pos // bs],
            # in place of six small tensor ops that cost more than the lookup itself.
            pos = np.asarray(start_positions, dtype=np.int64)
            blocks = self._table_np[np.asarray(rows, dtype=np.int64), pos // bs].astype(np.int64)
            return torch.from_numpy(blocks * bs + pos % bs)
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)  # (R,)
        starts = torch.tensor(start_positions, dtype=torch.int64, device=dev)  # (R,)
        counts = torch.tensor(num_tokens, dtype=torch.int64, device=dev)  # (R,)
        # Which request each flat token belongs to: the number of request ends at or
        # before it. (torch.repeat_interleave says the same, and table[rows, cols]
        # would gather, but on CPU both open an OpenMP parallel region that can cost
        # milliseconds on a busy machine; cumsum and index_select stay serial.)
        ends = torch.cumsum(counts, 0)  # (R,)
        boundaries = torch.zeros(total + 1, dtype=torch.int64, device=dev)
        boundaries.index_add_(0, ends, torch.ones_like(ends))
        req_idx = torch.cumsum(boundaries[:total], 0)  # (T,)
        # Token t of request i is its (t - first[i])-th new token: position start[i] + that.
        shift = torch.index_select(starts - (ends - counts), 0, req_idx)  # (T,)
        positions = torch.arange(total, dtype=torch.int64, device=dev) + shift  # (T,)
        token_rows = torch.index_select(rows_t, 0, req_idx)  # (T,)
        # Gather block_ids = table[token_rows, positions // bs] from the flattened table.
        flat_index = token_rows * self.max_num_blocks_per_req + positions // bs  # (T,)
        block_ids = torch.index_select(self._device_table().view(-1), 0, flat_index)  # (T,)
        return block_ids.to(torch.int64) * bs + positions % bs  # (T,)

    def _device_table(self) -> torch.Tensor:
        """The table on ``device``, with the rows changed since last time copied over."""
        if self._dirty_rows and self._table_dev is not self._table_cpu:
            rows = torch.tensor(sorted(self._dirty_rows), dtype=torch.int64)
            self._table_dev[rows.to(self.device)] = self._table_cpu[rows].to(self.device)
        self._dirty_rows.clear()
        return self._table_dev

    def _row(self, req_id: str) -> int:
        row = self._row_of.get(req_id)
        if row is None:
            raise ValueError(f"req_id {req_id!r} has no block table")
        return row
