"""The rejection sampler, fast twin: every request and position at once.

Read ``minivllm/ref/rejection_sampler.py`` first for the rule. This twin emits
the same tokens (the tests compare them exactly, under the same generators):
it reads the same randomness and decides with the same float32 operations on
the same values. What changes is the shape of the work:

- **No Python loop over requests or positions.** Acceptance is one vectorised
  compare over all drafts, ``u * q(x) < p(x)`` (greedy: ``x == argmax``); the
  accepted length of each request is a cumulative product along its row.
- **One extra-token row per request, not one per position.** The ref would
  be as fast as this only if it stopped at the first rejection too; a naive
  vectorisation (and vLLM's kernel) samples a recovered token at *every*
  position, ``num_draft_tokens x V`` work, and then throws all but one away.
  Here only the row each request actually needs is touched, ``B x V``: the
  bonus token is the special case ``q = 0`` of the recovered token
  (``max(p - 0, 0) = p``), so one formula serves both.
- **On CUDA, one Triton kernel** (:func:`rejection_sample_triton`), one program
  per request: it scans the drafts, then makes one pass over the vocabulary
  for the extra token, computing ``max(p - q, 0) / e`` on the fly instead of
  materialising ``(B, V)`` residuals. Its division is ``div_rn`` (IEEE
  round-to-nearest, what torch computes); Triton's ``/`` on float32 is an
  approximate division on GPUs and could pick a different token in a near-tie.

The target distribution comes from :mod:`minivllm.fast.sampler` (bit-identical
to the ref sampler). Everything else (inputs, randomness, per-position
sampling parameters) is shared with the ref through
:mod:`minivllm.spec_decode.metadata`.
"""

from __future__ import annotations

import torch

from minivllm.fast.sampler import _filter_logits_, apply_penalties
from minivllm.ref.rejection_sampler import verify_greedy, verify_random  # the per-request rule
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.spec_decode.metadata import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSamplerOutput,
    SpecDecodeMetadata,
    check_inputs,
    draw_rejection_randomness,
    expand_sampling_metadata,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the torch path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["rejection_sample", "verify_greedy", "verify_random"]


def rejection_sample(
    target_logits: torch.Tensor,
    spec_metadata: SpecDecodeMetadata,
    draft_probs: torch.Tensor | None,
    sampling_metadata: SamplingMetadata,
) -> RejectionSamplerOutput:
    """Verify one step's drafts against the target (see the ref twin for the arguments).

    The Triton kernel on CUDA when Triton is installed; vectorised torch otherwise.
    """
    if target_logits.device.type == "cuda" and _triton_installed():
        return rejection_sample_triton(target_logits, spec_metadata, draft_probs,
                                       sampling_metadata)
    return rejection_sample_torch(target_logits, spec_metadata, draft_probs, sampling_metadata)


def _triton_installed() -> bool:
    from minivllm.backend import triton_available

    return triton_available()


def _target(
    target_logits: torch.Tensor, spec_metadata: SpecDecodeMetadata,
    sampling_metadata: SamplingMetadata,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(target_argmax (T,) or None, target_probs (T, V) or None)``, as the sampler sees them."""
    per_position = expand_sampling_metadata(sampling_metadata, spec_metadata)
    logits = target_logits.to(torch.float32, copy=True)  # (T, V), the only copy
    apply_penalties(logits, per_position)
    target_argmax = None if sampling_metadata.all_random else logits.argmax(dim=-1)
    target_probs = None
    if not sampling_metadata.all_greedy:
        target_probs = _filter_logits_(logits, per_position).softmax(dim=-1)
    return target_argmax, target_probs


def rejection_sample_torch(
    target_logits: torch.Tensor,
    spec_metadata: SpecDecodeMetadata,
    draft_probs: torch.Tensor | None,
    sampling_metadata: SamplingMetadata,
) -> RejectionSamplerOutput:
    """:func:`rejection_sample` in vectorised torch, on any device."""
    check_inputs(target_logits, spec_metadata, draft_probs, sampling_metadata)
    target_argmax, target_probs = _target(target_logits, spec_metadata, sampling_metadata)
    uniform, exponentials = draw_rejection_randomness(sampling_metadata, spec_metadata)
    device = target_logits.device
    num_requests, spec_len = spec_metadata.num_requests, spec_metadata.max_spec_len
    num_drafts = spec_metadata.total_num_draft_tokens
    vocab_size = target_logits.shape[1]

    counts = torch.tensor(spec_metadata.num_draft_tokens, dtype=torch.int64, device=device)
    first_draft = spec_metadata.cu_num_draft_tokens - counts  # (B,)
    first_row = first_draft + torch.arange(num_requests, device=device)  # (B,) logits rows
    request = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)  # (N,)
    position = torch.arange(num_drafts, device=device) - first_draft[request]  # (N,)
    rows = torch.arange(num_drafts, device=device) + request  # (N,) each draft's logits row
    x = spec_metadata.draft_token_ids  # (N,)
    greedy = sampling_metadata.greedy_mask  # (B,)

    # Acceptance of every draft at once.
    accept = torch.zeros(num_drafts, dtype=torch.bool, device=device)
    if target_probs is not None:
        p_x = target_probs[rows, x]  # (N,)
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[
            torch.arange(num_drafts, device=device), x]
        accept = uniform * q_x < p_x
    if target_argmax is not None:
        accept = torch.where(greedy[request], x == target_argmax[rows], accept)
    accepted = torch.zeros(num_requests, max(spec_len, 1), dtype=torch.int64, device=device)
    accepted[request, position] = accept.to(torch.int64)
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # (B,) leading accepts
    emit_row = first_row + num_accepted  # (B,) the row of the extra token

    extra = torch.zeros(num_requests, dtype=torch.int64, device=device)
    if target_probs is not None:
        p = target_probs[emit_row]  # (B, V)
        residual = p
        if num_drafts:
            rejected = (first_draft + num_accepted).clamp(max=num_drafts - 1)  # (B,)
            if draft_probs is None:
                q = torch.nn.functional.one_hot(x[rejected], vocab_size).to(torch.float32)
            else:
                q = draft_probs[rejected]  # (B, V)
            q = q.masked_fill((num_accepted == counts)[:, None], 0.0)  # bonus: q = 0
            residual = (p - q).clamp_(min=0)
        empty = ~(residual > 0).any(dim=-1, keepdim=True)  # (B, 1)
        residual = torch.where(empty, p, residual)
        extra = (residual / exponentials).argmax(dim=-1)
    if target_argmax is not None:
        extra = torch.where(greedy, target_argmax[emit_row], extra)

    drafts = torch.full((num_requests, spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                        device=device)
    drafts[request, position] = x
    cols = torch.arange(spec_len + 1, device=device)
    output = drafts.masked_fill(cols[None, :] >= num_accepted[:, None], PLACEHOLDER_TOKEN_ID)
    output[torch.arange(num_requests, device=device), num_accepted] = extra
    return RejectionSamplerOutput(output_token_ids=output, num_accepted_tokens=num_accepted)


@triton.jit
def _rejection_sample_kernel(
    output_ptr,  # (B, S + 1) int64, prefilled with PLACEHOLDER_TOKEN_ID
    num_accepted_ptr,  # (B,) int64, written
    cu_num_draft_ptr,  # (B,) int64 inclusive cumulative draft counts
    draft_ptr,  # (N,) int64 draft ids (a 1-element dummy when N == 0)
    is_greedy_ptr,  # (B,) int32
    target_argmax_ptr,  # (T,) int64 (a dummy when no request is greedy)
    target_probs_ptr,  # (T, V) float32 contiguous (a dummy when every request is greedy)
    draft_probs_ptr,  # (N, V) float32 contiguous (unused when IS_NGRAM)
    uniform_ptr,  # (N,) float32
    exponentials_ptr,  # (B, V) float32 contiguous
    vocab_size,  # V
    output_stride,  # S + 1
    IS_NGRAM: tl.constexpr,  # no draft_probs: q is one-hot on the draft
    BLOCK: tl.constexpr,  # vocabulary entries per iteration of the extra-token pass
):
    req = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_num_draft_ptr + req)
    start = tl.where(req > 0, tl.load(cu_num_draft_ptr + tl.maximum(req - 1, 0)), 0)
    k = end - start
    row0 = start + req  # this request's first target row
    greedy = tl.load(is_greedy_ptr + req) != 0

    # 1. Scan the drafts: count the leading accepts.
    num_acc = 0
    still = 1
    for j in range(0, k):
        x = tl.load(draft_ptr + start + j)
        if greedy:
            ok = tl.load(target_argmax_ptr + row0 + j) == x
        else:
            p_x = tl.load(target_probs_ptr + (row0 + j) * vocab_size + x)
            if IS_NGRAM:
                q_x = 1.0
            else:
                q_x = tl.load(draft_probs_ptr + (start + j) * vocab_size + x)
            ok = tl.load(uniform_ptr + start + j) * q_x < p_x
        still = still & ok.to(tl.int32)
        num_acc += still
    for j in range(0, num_acc):
        tl.store(output_ptr + req * output_stride + j, tl.load(draft_ptr + start + j))

    # 2. The extra token at row0 + num_acc: recovered (q = the rejected draft's) or bonus (q = 0).
    row = row0 + num_acc
    if greedy:
        token = tl.load(target_argmax_ptr + row).to(tl.int64)
    else:
        q_end = tl.where(num_acc < k, vocab_size, 0)  # 0: bonus, q = 0 everywhere
        rejected = tl.maximum(tl.minimum(start + num_acc, end - 1), 0)
        x_rej = tl.load(draft_ptr + rejected)
        best_r = -1.0  # scores are >= 0, so any real entry beats these
        best_p = -1.0
        arg_r = 0
        arg_p = 0
        any_positive = 0
        for off in range(0, vocab_size, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            p = tl.load(target_probs_ptr + row * vocab_size + cols, mask=mask, other=0.0)
            if IS_NGRAM:
                q = tl.where((cols == x_rej) & (cols < q_end), 1.0, 0.0)
            else:
                q = tl.load(draft_probs_ptr + rejected * vocab_size + cols,
                            mask=cols < q_end, other=0.0)
            residual = tl.maximum(p - q, 0.0)
            e = tl.load(exponentials_ptr + req * vocab_size + cols, mask=mask, other=1.0)
            score_r = tl.where(mask, tl.math.div_rn(residual, e), -1.0)
            score_p = tl.where(mask, tl.math.div_rn(p, e), -1.0)
            # Running argmax; strict > keeps the first index on ties, as torch.argmax.
            block_r = tl.max(score_r, 0)
            take_r = block_r > best_r
            arg_r = tl.where(take_r, tl.argmax(score_r, 0, tie_break_left=True) + off, arg_r)
            best_r = tl.where(take_r, block_r, best_r)
            block_p = tl.max(score_p, 0)
            take_p = block_p > best_p
            arg_p = tl.where(take_p, tl.argmax(score_p, 0, tie_break_left=True) + off, arg_p)
            best_p = tl.where(take_p, block_p, best_p)
            any_positive = any_positive | (tl.max(residual, 0) > 0).to(tl.int32)
        token = tl.where(any_positive != 0, arg_r, arg_p).to(tl.int64)
    tl.store(output_ptr + req * output_stride + num_acc, token)
    tl.store(num_accepted_ptr + req, num_acc.to(tl.int64))


def rejection_sample_triton(
    target_logits: torch.Tensor,
    spec_metadata: SpecDecodeMetadata,
    draft_probs: torch.Tensor | None,
    sampling_metadata: SamplingMetadata,
) -> RejectionSamplerOutput:
    """:func:`rejection_sample` by the Triton kernel (CUDA, or the interpreter on a CPU)."""
    check_inputs(target_logits, spec_metadata, draft_probs, sampling_metadata)
    target_argmax, target_probs = _target(target_logits, spec_metadata, sampling_metadata)
    uniform, exponentials = draw_rejection_randomness(sampling_metadata, spec_metadata)
    device = target_logits.device
    num_requests, vocab_size = spec_metadata.num_requests, target_logits.shape[1]
    output = torch.full((num_requests, spec_metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int64, device=device)
    num_accepted = torch.zeros(num_requests, dtype=torch.int64, device=device)
    if num_requests == 0:
        return RejectionSamplerOutput(output_token_ids=output, num_accepted_tokens=num_accepted)

    def dummy(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(1, dtype=dtype, device=device)

    drafts = spec_metadata.draft_token_ids
    _rejection_sample_kernel[(num_requests,)](
        output, num_accepted, spec_metadata.cu_num_draft_tokens,
        drafts if drafts.numel() else dummy(torch.int64),
        sampling_metadata.greedy_mask.to(torch.int32),
        dummy(torch.int64) if target_argmax is None else target_argmax,
        dummy(torch.float32) if target_probs is None else target_probs.contiguous(),
        dummy(torch.float32) if draft_probs is None else draft_probs.contiguous(),
        uniform if uniform.numel() else dummy(torch.float32),
        exponentials.contiguous(),
        vocab_size, output.shape[1],
        IS_NGRAM=draft_probs is None,
        BLOCK=min(triton.next_power_of_2(vocab_size), 1024),
        num_warps=4,
    )
    return RejectionSamplerOutput(output_token_ids=output, num_accepted_tokens=num_accepted)
