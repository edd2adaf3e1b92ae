"""What both rejection-sampler twins share: the step's drafts, the output, the randomness.

One speculative step, for a batch of ``B`` requests where request ``i`` has
``k_i >= 0`` draft tokens (names follow vLLM v1, ``vllm/v1/spec_decode/metadata.py``)::

    draft_token_ids      (num_draft_tokens,)      the drafts, request after request
    cu_num_draft_tokens  (B,)                     inclusive cumulative sum of k_i
    target_logits        (num_draft_tokens + B, V) per request: k_i + 1 rows, the
                                                  target's logits after each prefix
                                                  of its drafts (row j scores draft j;
                                                  row k_i is the bonus position)
    draft_probs          (num_draft_tokens, V)    q, the distribution each draft was
                                                  sampled from, or None (n-gram:
                                                  q is one-hot on the draft)

The rejection sampler returns, per request, the accepted drafts followed by one
more token (the *recovered* token at the first rejection, or the *bonus* token
when every draft was accepted): between 1 and ``k_i + 1`` tokens.

Both twins get their randomness from :func:`draw_rejection_randomness` and
their target distribution from :func:`expand_sampling_metadata` plus the
sampler's own penalty and filter stages, so they emit identical tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.sampling_metadata import SamplingMetadata, draw_exponentials

#: Fills ``output_token_ids`` after each request's last emitted token (vLLM's value).
PLACEHOLDER_TOKEN_ID = -1

#: The most draft tokens one request may carry in one step (vLLM uses 32 too).
MAX_SPEC_LEN = 32


@dataclass(frozen=True)
class SpecStats:
    """One step's verification counts, as vLLM's ``SpecDecodingStats``.

    Attributes:
        num_drafts: requests that verified at least one draft.
        num_draft_tokens: drafts verified.
        num_accepted_tokens: drafts accepted (the extra token is not counted).
        num_accepted_tokens_per_pos: per draft position ``j``, how many
            requests accepted their draft ``j`` (length ``k``).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()


def count_verified(drafts: Sequence[tuple[int, ...]], tokens: Sequence[list[int]], k: int) -> SpecStats:
    """This step's verification counts (vLLM's ``SpecDecodingStats``), ``k`` positions."""
    per_pos = [0] * k
    num_drafts = num_draft_tokens = num_accepted = 0
    for d, t in zip(drafts, tokens):
        if not d:
            continue
        accepted = len(t) - 1
        num_drafts += 1
        num_draft_tokens += len(d)
        num_accepted += accepted
        for j in range(accepted):
            per_pos[j] += 1
    return SpecStats(num_drafts, num_draft_tokens, num_accepted, tuple(per_pos))


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """One step's draft tokens, on the device and on the host.

    Build it with :meth:`make`. Request ``i``'s drafts are
    ``draft_token_ids[cu_num_draft_tokens[i] - k_i : cu_num_draft_tokens[i]]``
    and its target logits rows are ``[cu_num_logits[i] - k_i - 1, cu_num_logits[i])``.

    Attributes:
        draft_token_ids: (num_draft_tokens,) int64, on the device.
        cu_num_draft_tokens: (B,) int64 inclusive cumulative sum of ``k_i``, on the device.
        num_draft_tokens: ``[k_0, ..., k_{B-1}]`` on the host.
        draft_token_ids_cpu: the drafts per request, on the host.
        max_spec_len: ``max(k_i)`` (0 for an empty or draft-free batch).
    """

    draft_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    num_draft_tokens: list[int]
    draft_token_ids_cpu: list[list[int]]
    max_spec_len: int

    @property
    def num_requests(self) -> int:
        """``B``."""
        return len(self.num_draft_tokens)

    @property
    def total_num_draft_tokens(self) -> int:
        """``sum(k_i)``: the rows of ``draft_probs``."""
        return sum(self.num_draft_tokens)

    @property
    def num_logits(self) -> int:
        """``sum(k_i + 1)``: the rows of ``target_logits``."""
        return self.total_num_draft_tokens + self.num_requests

    @property
    def cu_num_logits(self) -> torch.Tensor:  # (B,) int64
        """Inclusive cumulative sum of ``k_i + 1``: where each request's logits rows end."""
        ones = torch.arange(1, self.num_requests + 1, device=self.cu_num_draft_tokens.device)
        return self.cu_num_draft_tokens + ones

    @classmethod
    def make(
        cls,
        draft_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SpecDecodeMetadata:
        """The metadata for ``draft_token_ids[i]``, request ``i``'s drafts (may be empty).

        Raises ``ValueError`` if a request has more than :data:`MAX_SPEC_LEN`
        drafts or a draft id is outside ``[0, vocab_size)``.
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
        rows = [list(map(int, ids)) for ids in draft_token_ids]
        for i, ids in enumerate(rows):
            if len(ids) > MAX_SPEC_LEN:
                raise ValueError(f"draft_token_ids[{i}] has {len(ids)} drafts; at most "
                                 f"MAX_SPEC_LEN={MAX_SPEC_LEN} are allowed")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"draft_token_ids[{i}] has ids {bad} outside "
                                 f"[0, vocab_size={vocab_size})")
        counts = [len(ids) for ids in rows]
        flat = np.fromiter((t for ids in rows for t in ids), dtype=np.int64, count=sum(counts))
        return cls(
            draft_token_ids=torch.from_numpy(flat).to(device),
            cu_num_draft_tokens=torch.tensor(np.cumsum(counts, dtype=np.int64), device=device),
            num_draft_tokens=counts,
            draft_token_ids_cpu=rows,
            max_spec_len=max(counts, default=0),
        )


@dataclass(frozen=True)
class RejectionSamplerOutput:
    """What the rejection sampler returns for one step.

    Attributes:
        output_token_ids: (B, max_spec_len + 1) int64. Row ``i`` holds the
            accepted drafts, then the recovered or bonus token, then
            :data:`PLACEHOLDER_TOKEN_ID`.
        num_accepted_tokens: (B,) int64, drafts accepted per request; request
            ``i`` emits ``num_accepted_tokens[i] + 1`` tokens.
    """

    output_token_ids: torch.Tensor
    num_accepted_tokens: torch.Tensor

    def parse_output(self) -> list[list[int]]:
        """Each request's emitted tokens, on the host (vLLM's name)."""
        rows = self.output_token_ids.cpu().tolist()
        counts = self.num_accepted_tokens.cpu().tolist()
        return [row[: n + 1] for row, n in zip(rows, counts)]


def check_inputs(
    target_logits: torch.Tensor,
    spec_metadata: SpecDecodeMetadata,
    draft_probs: torch.Tensor | None,
    sampling_metadata: SamplingMetadata,
) -> None:
    """Raise ``ValueError`` naming the argument if the shapes do not fit together."""
    num_requests, vocab = spec_metadata.num_requests, sampling_metadata.vocab_size
    if sampling_metadata.num_rows != num_requests:
        raise ValueError(f"sampling_metadata has {sampling_metadata.num_rows} rows but "
                         f"spec_metadata has {num_requests} requests")
    want = (spec_metadata.num_logits, vocab)
    if target_logits.dim() != 2 or tuple(target_logits.shape) != want:
        raise ValueError(f"target_logits must have shape (num_draft_tokens + B, V) = {want}, "
                         f"got {tuple(target_logits.shape)}")
    if draft_probs is not None:
        want = (spec_metadata.total_num_draft_tokens, vocab)
        if tuple(draft_probs.shape) != want:
            raise ValueError(f"draft_probs must be None or have shape (num_draft_tokens, V) "
                             f"= {want}, got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != torch.float32:
            raise ValueError(f"draft_probs must be float32, got {draft_probs.dtype}")


def logits_row_index(spec_metadata: SpecDecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target-logits row, its request and its position (0..k_i), both (num_logits,) int64."""
    device = spec_metadata.cu_num_draft_tokens.device
    per_request = torch.tensor(spec_metadata.num_draft_tokens, dtype=torch.int64) + 1  # (B,)
    request = torch.repeat_interleave(torch.arange(spec_metadata.num_requests), per_request)
    starts = torch.cumsum(per_request, 0) - per_request  # (B,) first row of each request
    position = torch.arange(spec_metadata.num_logits) - starts[request]
    return request.to(device), position.to(device)


def expand_sampling_metadata(
    metadata: SamplingMetadata, spec_metadata: SpecDecodeMetadata
) -> SamplingMetadata:
    """``metadata`` (one row per request) as one row per target-logits row.

    Row ``(i, j)`` (request ``i``, position ``j``) gets request ``i``'s
    temperature, filters and penalties, and for the penalties its output
    tokens *followed by its drafts* ``0..j-1``: the output that position would
    follow if those drafts are accepted, which is the only case in which its
    token is used. So the target distribution at every position is exactly
    the one plain decoding would sample from.

    ``min_tokens`` is the exception: the (row, id) pairs it masks are given per
    request, not per position, so they are applied at every position of the
    request. That is exact when the request is either past ``min_tokens`` or
    stays below it for all ``k_i + 1`` positions; the caller keeps it so by
    proposing at most ``min_tokens - num_output_tokens - 1`` drafts while a
    request is below ``min_tokens``.

    The result is for penalties and filters only: it draws no randomness
    (``generators`` and ``unseeded_rows`` are empty); randomness comes from
    :func:`draw_rejection_randomness` with the per-request metadata.
    """
    request, position = logits_row_index(spec_metadata)  # (T,), (T,)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[request]

    output_token_ids = metadata.output_token_ids
    if output_token_ids is not None:
        vocab = metadata.vocab_size
        width = max(spec_metadata.max_spec_len, 1)
        drafts = torch.full((spec_metadata.num_requests, width), vocab, dtype=torch.int64,
                            device=output_token_ids.device)  # (B, S), padded with V
        if spec_metadata.total_num_draft_tokens:
            counts = torch.tensor(spec_metadata.num_draft_tokens)
            req_of_draft = torch.repeat_interleave(torch.arange(len(counts)), counts)
            pos_of_draft = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0)
                                                              - counts)[req_of_draft]
            drafts[req_of_draft, pos_of_draft] = spec_metadata.draft_token_ids.to(drafts.device)
        drafts = drafts[request]  # (T, S)
        cols = torch.arange(width, device=drafts.device)
        drafts = drafts.masked_fill(cols[None, :] >= position[:, None], vocab)  # drafts 0..j-1
        output_token_ids = torch.cat([output_token_ids[request], drafts], dim=1)

    min_tokens_rows = min_tokens_ids = None
    if metadata.min_tokens_rows is not None:
        # Every (row, id) pair of request i becomes a pair for each of its rows.
        is_row = request[:, None] == metadata.min_tokens_rows[None, :]  # (T, M)
        logit_row, pair = is_row.nonzero(as_tuple=True)
        min_tokens_rows, min_tokens_ids = logit_row, metadata.min_tokens_ids[pair]

    return SamplingMetadata(
        temperature=metadata.temperature[request],
        all_greedy=metadata.all_greedy,
        all_random=metadata.all_random,
        top_k=rows(metadata.top_k),
        max_top_k=metadata.max_top_k,
        top_p=rows(metadata.top_p),
        min_p=rows(metadata.min_p),
        generator=metadata.generator,
        generators={},
        unseeded_rows=[],
        presence_penalties=rows(metadata.presence_penalties),
        frequency_penalties=rows(metadata.frequency_penalties),
        repetition_penalties=rows(metadata.repetition_penalties),
        prompt_token_ids=rows(metadata.prompt_token_ids),
        output_token_ids=output_token_ids,
        min_tokens_rows=min_tokens_rows,
        min_tokens_ids=min_tokens_ids,
        max_num_logprobs=metadata.max_num_logprobs,
        vocab_size=metadata.vocab_size,
    )


def draw_rejection_randomness(
    metadata: SamplingMetadata, spec_metadata: SpecDecodeMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """The only randomness of a verification step: ``(uniform, exponentials)``.

    - ``exponentials`` (B, V): one ``Exp(1)`` vector per random request, drawn
      exactly as the plain sampler draws it (:func:`draw_exponentials`). It
      samples the request's one extra token, recovered or bonus, by the
      exponential race ``argmax(weights / exponentials)``. One vector per
      request is enough: only one extra token per request is ever used, and
      which one depends only on ``uniform``, which is independent of it.
    - ``uniform`` (num_draft_tokens,): one ``U[0, 1)`` per draft of a random
      request, drawn after the exponentials: the unseeded requests' drafts
      as one block from the engine's generator, in batch order, then each
      seeded request's ``k_i`` values from its own generator. Greedy requests
      draw nothing (their values are 0 and unused).

    So a seeded request's generator sees ``V`` exponentials then ``k_i``
    uniforms whatever else is in the batch, and a step with no drafts draws
    exactly what the plain sampler draws (the same tokens).
    """
    exponentials = draw_exponentials(metadata, metadata.vocab_size)  # (B, V)
    device = exponentials.device
    uniform = torch.zeros(spec_metadata.total_num_draft_tokens, dtype=torch.float32,
                          device=device)
    if metadata.all_greedy or not spec_metadata.total_num_draft_tokens:
        return uniform, exponentials
    counts = spec_metadata.num_draft_tokens
    starts = np.cumsum([0] + counts[:-1]).tolist()

    def span(row: int) -> slice:
        return slice(starts[row], starts[row] + counts[row])

    unseeded = [r for r in metadata.unseeded_rows if counts[r]]
    if unseeded:
        block = torch.empty(sum(counts[r] for r in unseeded), dtype=torch.float32,
                            device=device).uniform_(generator=metadata.generator)
        at = 0
        for r in unseeded:
            uniform[span(r)] = block[at : at + counts[r]]
            at += counts[r]
    for row, gen in metadata.generators.items():
        if counts[row]:
            uniform[span(row)].uniform_(generator=gen)
    return uniform, exponentials
