"""The small dataclasses that carry one step's data down the pipeline.

request -> scheduler -> :class:`SchedulerOutput` -> model runner ->
:class:`AttentionMetadata` (+ input ids, positions) -> model -> logits ->
sampler -> sampled tokens -> scheduler.update_from_output.

Metadata is always passed as an explicit argument, never through global state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.request import Request


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step.

    Attributes:
        scheduled_requests: the requests to run this step, running ones first
            (in their running order), then newly admitted ones.
        num_scheduled_tokens: request_id -> number of new tokens to compute
            this step. Request ``r`` computes ``r.all_token_ids[r.num_computed_tokens :
            r.num_computed_tokens + n]`` at positions starting at
            ``r.num_computed_tokens`` (``num_computed_tokens`` is advanced by
            ``update_from_output``, after the forward pass).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``.
        preempted_req_ids: requests preempted this step (blocks freed, sent
            back to the front of the waiting queue).
        finished_req_ids: requests that finished or were aborted since the
            last step (the model runner drops their per-request state).
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class AttentionMetadata:
    """Where each token of a flattened, unpadded batch reads and writes the KV cache.

    A batch concatenates ``num_seqs`` query chunks. Sequence ``i`` owns query
    rows ``query_start_loc[i] : query_start_loc[i + 1]``; those are its last
    ``query_len`` tokens out of ``seq_lens[i]`` (so its first
    ``seq_lens[i] - query_len`` tokens are already in the cache: earlier
    chunks, earlier decode steps, or prefix-cache hits). A decode is simply a
    sequence with ``query_len == 1``.

    Attributes:
        slot_mapping: ``(num_tokens,)`` int64; where to write each new token's
            K/V: ``slot = block_id * block_size + offset``. ``-1`` = skip
            (padding rows).
        block_tables: ``(num_seqs, max_blocks_per_seq)`` int32; physical block
            ids of each sequence, in order; unused entries are 0.
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        seq_lens: ``(num_seqs,)`` int32 context length after this step.
        max_query_len: ``max(query lens)``, a Python int (for launch grids).
        max_seq_len: ``max(seq_lens)``, a Python int.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        """Tokens of each sequence already cached before this step."""
        return self.seq_lens - self.query_lens


@dataclass
class ModelInput:
    """Everything one forward pass needs, built by the model runner from a
    :class:`SchedulerOutput`. On tensor-parallel runs rank 0 builds it and
    broadcasts it to the other ranks.

    Attributes:
        input_ids: ``(num_tokens,)`` int64, the flattened batch.
        positions: ``(num_tokens,)`` int64, each token's position in its sequence.
        attn_metadata: where each token reads and writes the paged KV cache.
        logits_indices: ``(num_sampled,)`` int64 rows of the hidden states
            whose next-token logits are needed (the last scheduled token of
            every request that samples this step).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
