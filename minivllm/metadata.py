"""The small dataclasses that carry one step's data down the pipeline.

scheduler -> :class:`SchedulerOutput` -> :class:`StepInput` (sent to every rank; its
plan: :mod:`minivllm.step_sampling`) -> worker (applies the block-table changes to its own
table) -> :class:`ModelInput` with its :class:`AttentionMetadata` -> model -> logits ->
the worker's sampler -> token ids -> scheduler.update_from_output. Always explicit
arguments, never global state.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from minivllm.request import Request
from minivllm.step_sampling import SamplingPlan


@dataclass(frozen=True)
class ScheduledRequest:
    """One scheduled request as it was when the scheduler decided (a snapshot).

    vLLM's ``NewRequestData`` / ``CachedRequestData`` in one record, copied when the
    :class:`SchedulerOutput` is made, so the step never reads a live ``Request``
    that a later step (a pipeline keeps several in flight) may have advanced.

    Attributes:
        request_id: the request.
        num_computed_tokens: tokens whose K/V were in the cache before this step.
        num_scheduled_tokens: tokens this step computes (its drafts included).
        token_ids: those tokens: the next ones of the request (a prefill
            chunk, or its last sampled token), then its drafts. Shorter than
            ``num_scheduled_tokens`` only if the request does not have them
            (the engine then fails that request alone).
        spec_token_ids: the draft tokens it verifies (the tail of ``token_ids``).
        num_tokens: prompt plus output tokens it had (drafts not counted).
        num_prompt_tokens: its prompt's length.
        new_block_ids: the block ids its block-table row gains this step.
        is_new: admitted this step (new, or resumed after a preemption): the
            worker gives it a new row.
        wants_prompt_logprobs: it asked for ``prompt_logprobs`` (logits at its prompt positions).
    """

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    token_ids: tuple[int, ...]
    spec_token_ids: tuple[int, ...]
    num_tokens: int
    num_prompt_tokens: int
    new_block_ids: tuple[int, ...]
    is_new: bool
    wants_prompt_logprobs: bool = False

    def check_tokens(self) -> None:
        """Raise ``ValueError`` unless the request had every token it was scheduled for."""
        if len(self.token_ids) != self.num_scheduled_tokens:
            raise ValueError(f"request {self.request_id!r}: {self.num_scheduled_tokens} tokens "
                             f"scheduled from {self.num_computed_tokens}, but it has "
                             f"{self.num_tokens}")

    @property
    def samples(self) -> bool:
        """Whether this step samples a token for it: every token it has is then computed
        (a prefill chunk that is not the last one samples nothing)."""
        return (self.num_computed_tokens + self.num_scheduled_tokens
                - len(self.spec_token_ids)) == self.num_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """This step's positions whose logits score the next *prompt* token (prompt logprobs)."""
        start = self.num_computed_tokens
        end = min(start + self.num_scheduled_tokens, self.num_prompt_tokens - 1)
        return range(start, end if self.wants_prompt_logprobs else start)

    @property
    def is_decode(self) -> bool:
        """A decode: its prompt was computed, and it computes one token (plus its drafts)."""
        return (self.num_computed_tokens >= self.num_prompt_tokens
                and self.num_scheduled_tokens == 1 + len(self.spec_token_ids))


@dataclass(frozen=True)
class SchedulerOutput:
    """What the scheduler decided for one step; frozen, and made of snapshots.

    The scheduler (a course component) builds it with the fields below; the
    constructor turns every container into an immutable one and snapshots
    each scheduled request (:attr:`scheduled`), so whatever reads it later
    (the batch builder, the sampler, the statistics; a step in flight on a
    pipeline) sees the step as it was decided.

    Attributes:
        scheduled_requests: the requests to run this step, running ones first
            (in their running order), then newly admitted ones. Only the
            scheduler itself (its ``update_from_output``) touches these live
            objects; everything else reads :attr:`scheduled`.
        num_scheduled_tokens: request_id -> number of new tokens to compute
            this step. Request ``r`` computes ``r.all_token_ids[r.num_computed_tokens :
            r.num_computed_tokens + n]`` at positions starting at
            ``r.num_computed_tokens`` (``num_computed_tokens`` is advanced by
            ``update_from_output``, after the forward pass).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``.
        preempted_req_ids: requests preempted this step (blocks freed, sent
            back to the front of the waiting queue; the workers drop their rows,
            and give them new ones when they are admitted again).
        finished_req_ids: requests that finished or were aborted since the
            last step (the workers drop their block-table rows).
        new_req_ids: the scheduled requests admitted this step (new, or
            resumed after a preemption): the worker gives each a new row in
            its block table.
        new_block_ids: request_id -> KV block ids appended to that request's
            block table this step, for every scheduled request (often ``[]``
            for a decode); for a request in ``new_req_ids``, all of its blocks
            (prefix-cache hits first). With ``preempted_req_ids`` and
            ``finished_req_ids`` (whose rows are dropped) this is everything a
            worker needs to keep its own block table in step with the
            scheduler, as vLLM v1's ``NewRequestData.block_ids`` and
            ``CachedRequestData.new_block_ids`` do.
        scheduled_spec_decode_tokens: request_id -> the draft tokens it
            verifies this step (speculative decoding; vLLM's name). Such a
            request computes its last sampled token plus these drafts, so its
            ``num_scheduled_tokens`` is ``1 + len(drafts)``; requests without
            drafts are absent.
        num_prefix_cache_queries: tokens of the requests admitted this step
            that were looked up in the prefix cache.
        num_prefix_cache_hits: of those, tokens found there (not recomputed).
        scheduled: (made by the constructor) one :class:`ScheduledRequest`
            snapshot per scheduled request, in ``scheduled_requests`` order.
    """

    scheduled_requests: Sequence[Request] = ()
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: Sequence[str] = ()
    finished_req_ids: Sequence[str] = ()
    new_req_ids: Sequence[str] = ()
    new_block_ids: Mapping[str, Sequence[int]] = field(default_factory=dict)
    scheduled_spec_decode_tokens: Mapping[str, Sequence[int]] = field(default_factory=dict)
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    scheduled: tuple[ScheduledRequest, ...] = field(init=False)

    def __post_init__(self) -> None:
        freeze = object.__setattr__  # a frozen dataclass sets its fields this way
        freeze(self, "scheduled_requests", tuple(self.scheduled_requests))
        freeze(self, "num_scheduled_tokens", MappingProxyType(dict(self.num_scheduled_tokens)))
        freeze(self, "preempted_req_ids", tuple(self.preempted_req_ids))
        freeze(self, "finished_req_ids", tuple(self.finished_req_ids))
        freeze(self, "new_req_ids", tuple(self.new_req_ids))
        freeze(self, "new_block_ids", MappingProxyType(
            {rid: tuple(ids) for rid, ids in self.new_block_ids.items()}))
        freeze(self, "scheduled_spec_decode_tokens", MappingProxyType(
            {rid: tuple(ids) for rid, ids in self.scheduled_spec_decode_tokens.items()}))
        new = set(self.new_req_ids)
        snapshots = []
        for r in self.scheduled_requests:
            rid, start = r.request_id, r.num_computed_tokens
            n = self.num_scheduled_tokens[rid]
            drafts = self.scheduled_spec_decode_tokens.get(rid, ())
            snapshots.append(ScheduledRequest(
                request_id=rid, num_computed_tokens=start, num_scheduled_tokens=n,
                token_ids=(*r.all_token_ids[start : start + n - len(drafts)], *drafts),
                spec_token_ids=drafts, num_tokens=r.num_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
                new_block_ids=self.new_block_ids.get(rid, ()), is_new=rid in new,
                wants_prompt_logprobs=getattr(r, "skip_reading_prefix_cache", False)))
        freeze(self, "scheduled", tuple(snapshots))

    @property
    def is_empty(self) -> bool:
        """True if no token is computed this step."""
        return self.total_num_scheduled_tokens == 0

    @property
    def removed_req_ids(self) -> tuple[str, ...]:
        """Requests whose block-table rows go away: finished, aborted or preempted."""
        return (*self.finished_req_ids, *self.preempted_req_ids)

    @property
    def decode_req_ids(self) -> frozenset[str]:
        """The scheduled decodes (one token, plus its drafts)."""
        return frozenset(r.request_id for r in self.scheduled if r.is_decode)


@dataclass(frozen=True)
class StepInput:
    """One step's batch as rank 0 sends it to every rank: host-side, no block tables.

    The engine builds it from a :class:`SchedulerOutput`
    (:meth:`from_scheduler_output`); each rank's
    :class:`~minivllm.worker.worker.Worker` first applies the block-table
    changes to its own table (drop ``removed_req_ids``, add a row for each of
    ``new_req_ids``, append ``new_block_ids``), then builds the step's
    :class:`ModelInput` (block tables and slot mapping from that table).
    Under tensor parallelism this object is what goes over the wire
    (:mod:`minivllm.executor.wire`), so its size does not grow with the
    requests' lengths, only with what changed.

    Attributes:
        req_ids: the scheduled requests, in batch order.
        new_req_ids: of those, the ones without a row yet (admitted this step).
        new_block_ids: per scheduled request (``req_ids`` order), the block
            ids to append to its row.
        removed_req_ids: finished, aborted or preempted since the last step;
            their rows are dropped first (ids without a row are ignored: a
            request aborted while it waited never had one).
        query_lens: new tokens of each scheduled request this step.
        seq_lens: context length of each after this step (so its positions
            are ``seq_len - query_len .. seq_len - 1``).
        input_ids: ``(num_tokens,)`` int64 CPU tensor, the flattened batch.
        positions: ``(num_tokens,)`` int64 CPU tensor.
        logits_indices: ``(num_logits,)`` int64 CPU tensor, the rows whose
            next-token logits are needed (per request: prompt-logprob rows, then sampled).
        prompt_logprob_rows: ``(request_id, first_position, first_row, count)`` per
            request with prompt-logprob rows (the engine copies them into the plan).
        lora_ids: per scheduled request, its LoRA adapter's ``lora_int_id`` (0:
            the base model); empty when no request of the step has one. Every
            rank knows each adapter by its id (``Executor.add_lora``).
        blocks_to_copy: ``(src, dst)`` KV blocks every rank copies (every
            layer's K and V) before the step's forward: the copy-on-write of a
            block shared by forked requests (parallel sampling, beam search).
            Empty unless a request forked.
        sampling: what the sampling worker does with the logits
            (:class:`~minivllm.step_sampling.SamplingPlan`); None: it returns them.
    """

    req_ids: tuple[str, ...]
    new_req_ids: frozenset[str]
    new_block_ids: tuple[tuple[int, ...], ...]
    removed_req_ids: tuple[str, ...]
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    lora_ids: tuple[int, ...] = ()
    prompt_logprob_rows: tuple[tuple[str, int, int, int], ...] = ()
    sampling: SamplingPlan | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (0: only block-table changes)."""
        return self.input_ids.numel()

    @classmethod
    def from_scheduler_output(cls, so: SchedulerOutput, failed: Sequence[str] = (),
                              rows: Mapping[str, Sequence[int]] | None = None,
                              blocks_to_copy: Sequence[tuple[int, int]] = ()) -> StepInput:
        """Flatten the scheduled chunks into one batch (leaving out the ``failed`` requests).

        For every scheduled request its tokens (``ScheduledRequest.token_ids``)
        are laid end to end, with no padding, with their positions; the rows
        whose logits are sampled are recorded: a request that samples this
        step has ``1 + d`` of them, its last real token then each of its ``d``
        drafts (a draft's logits score the token after it); before them, its
        :attr:`ScheduledRequest.prompt_logprob_positions`.

        ``rows``: scheduled requests whose block-table row is rebuilt whole
        (request id -> all its block ids): a request forked since the last
        step, or one whose shared block was replaced by its copy. Such a row
        is dropped and made again, as for a new request. ``blocks_to_copy``:
        the step's copy-on-write copies.
        """
        rows = {} if rows is None else rows
        token_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        prompt_rows: list[tuple[str, int, int, int]] = []
        reqs = [r for r in so.scheduled if r.request_id not in failed]
        for r in reqs:
            span = r.prompt_logprob_positions  # starts at num_computed_tokens
            if span:
                prompt_rows.append((r.request_id, span.start, len(logits_indices), len(span)))
                logits_indices.extend(range(len(token_ids), len(token_ids) + len(span)))
            token_ids.extend(r.token_ids)
            positions.extend(range(r.num_computed_tokens,
                                   r.num_computed_tokens + r.num_scheduled_tokens))
            if r.samples:
                end = len(token_ids)
                logits_indices.extend(range(end - 1 - len(r.spec_token_ids), end))
        return cls(
            req_ids=tuple(r.request_id for r in reqs),
            new_req_ids=frozenset(r.request_id for r in reqs
                                  if r.is_new or r.request_id in rows),
            new_block_ids=tuple(tuple(rows[r.request_id]) if r.request_id in rows
                                else r.new_block_ids for r in reqs),
            removed_req_ids=(*so.removed_req_ids,
                             *(r.request_id for r in reqs if r.request_id in rows)),
            query_lens=tuple(r.num_scheduled_tokens for r in reqs),
            seq_lens=tuple(r.num_computed_tokens + r.num_scheduled_tokens for r in reqs),
            input_ids=torch.tensor(token_ids, dtype=torch.int64),  # (T,)
            positions=torch.tensor(positions, dtype=torch.int64),  # (T,)
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),  # (num_sampled,)
            blocks_to_copy=tuple((int(s), int(d)) for s, d in blocks_to_copy),
            lora_ids=_lora_ids(so.scheduled_requests, failed),
            prompt_logprob_rows=tuple(prompt_rows),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a flattened, unpadded batch reads and writes the KV cache.

    A batch concatenates ``num_seqs`` query chunks. Sequence ``i`` owns query
    rows ``query_start_loc[i] : query_start_loc[i + 1]``; those are its last
    ``query_len`` tokens out of ``seq_lens[i]`` (so its first
    ``seq_lens[i] - query_len`` tokens are already in the cache: earlier
    chunks, earlier decode steps, or prefix-cache hits). A decode is simply a
    sequence with ``query_len == 1``.

    It is frozen: one step builds it once (:meth:`build`), and every layer of
    that step reads the same object. As in vLLM, the per-sequence lengths come
    twice: as device tensors for the kernels, and as host-side tuples
    (``*_host``) for anything that loops or decides on the host (launch grids,
    the ref's per-sequence loop), so no kernel has to copy them back from the
    device in every layer.

    Attributes:
        slot_mapping: ``(num_tokens,)`` int64; where to write each new token's
            K/V: ``slot = block_id * block_size + offset``. ``-1`` = skip
            (padding rows).
        block_tables: ``(num_seqs, max_blocks_per_seq)`` int32; physical block
            ids of each sequence, in order; unused entries are 0.
        query_start_loc: ``(num_seqs + 1,)`` int32 cumulative query lengths.
        seq_lens: ``(num_seqs,)`` int32 context length after this step.
        query_start_loc_host: ``query_start_loc`` as a tuple of Python ints.
        seq_lens_host: ``seq_lens`` as a tuple of Python ints.
        max_query_len: ``max(query lens)``, a Python int (for launch grids).
        max_seq_len: ``max(seq_lens)``, a Python int.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
              slot_mapping: torch.Tensor,  # (num_tokens,) int64
              device: str | torch.device | None = None) -> AttentionMetadata:
        """Metadata for sequences with these query and context lengths (host ints).

        The tensors go to ``device`` (default: ``block_tables``'s device).
        """
        if len(query_lens) != len(seq_lens):
            raise ValueError(f"query_lens and seq_lens must have one entry per sequence, "
                             f"got {len(query_lens)} and {len(seq_lens)}")
        device = block_tables.device if device is None else torch.device(device)
        qsl = (0, *itertools.accumulate(int(n) for n in query_lens))
        lens = tuple(int(n) for n in seq_lens)
        return cls(
            slot_mapping=slot_mapping.to(device, torch.int64),
            block_tables=block_tables.to(device, torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            query_start_loc_host=qsl,
            seq_lens_host=lens,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(lens, default=0),
        )

    def to(self, device: str | torch.device) -> AttentionMetadata:
        """The same metadata with its tensors on ``device``."""
        return dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping.to(device),
            block_tables=self.block_tables.to(device),
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def query_lens_host(self) -> tuple[int, ...]:
        """Query rows of each sequence this step (host ints)."""
        qsl = self.query_start_loc_host
        return tuple(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1))


@dataclass(frozen=True)
class ModelInput:
    """Everything one forward pass needs, on one rank's device.

    Each rank's :class:`~minivllm.worker.worker.Worker` builds it from a
    :class:`StepInput` and its own block table, once per step.

    Attributes:
        input_ids: ``(num_tokens,)`` int64, the flattened batch.
        positions: ``(num_tokens,)`` int64, each token's position in its sequence.
        attn_metadata: where each token reads and writes the paged KV cache.
        logits_indices: ``(num_logits,)`` int64 rows of the hidden states whose
            next-token logits are needed (as in :attr:`StepInput.logits_indices`).
        lora: each token's LoRA adapter slot (a :class:`~minivllm.lora.mapping.LoRAMapping`),
            or None when no token of the step has one. The slots' weights are the
            model's (:func:`minivllm.lora.layers.enable_lora`).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    lora: Any = None

    @classmethod
    def build(cls, block_tables: Any, req_ids: Sequence[str], query_lens: Sequence[int],
              seq_lens: Sequence[int], input_ids: torch.Tensor, positions: torch.Tensor,
              logits_indices: torch.Tensor, device: str | torch.device) -> ModelInput:
        """The model input for a flat batch over the rows of ``block_tables``.

        ``block_tables`` is a ``BlockTables`` (either twin) that already holds a
        row for each of ``req_ids``; request ``i`` computes its last
        ``query_lens[i]`` tokens of ``seq_lens[i]``. The one place a step's
        block tables and slot mapping are read out (the worker, and a draft
        model's proposer, build their inputs here).
        """
        req_ids = list(req_ids)
        starts = [s - q for s, q in zip(seq_lens, query_lens)]
        attn_metadata = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables.block_table_tensor(req_ids),
            slot_mapping=block_tables.slot_mapping(req_ids, starts, list(query_lens)),
            device=device,
        )
        return cls(input_ids=input_ids.to(device), positions=positions.to(device),
                   attn_metadata=attn_metadata, logits_indices=logits_indices.to(device))


def _lora_ids(requests: Sequence[Any], failed: Sequence[str]) -> tuple[int, ...]:
    """Each batch request's ``lora_int_id`` (0: none), or ``()`` when none has an adapter."""
    ids = tuple(0 if r.lora_request is None else r.lora_request.lora_int_id
                for r in requests if r.request_id not in failed)
    return ids if any(ids) else ()
