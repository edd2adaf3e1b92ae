"""The rejection sampler: keep a prefix of the drafts, exactly as the target would sample.

Speculative decoding (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", arXiv 2211.17192): a cheap proposer guesses ``k``
tokens, the target model scores all ``k + 1`` prefixes in one forward pass,
and this component decides, per request, how many drafts to keep. The rule,
for each draft ``x_j`` in order, with ``p`` the target's distribution at that
position and ``q`` the distribution the draft was sampled from::

    accept x_j with probability min(1, p(x_j) / q(x_j))
    on the first rejection: emit one token from norm(max(p - q, 0)), stop
    if all k are accepted:  emit a bonus token from p at position k

Greedy requests (temperature 0) accept while the draft equals the target's
argmax and then emit the argmax. An n-gram proposer gives no ``q``: it is
one-hot on the draft, so ``x_j`` is kept with probability ``p(x_j)``.

Each emitted token is distributed exactly as the target's ``p`` at its
position (the proof is in ``docs/speculative_decoding.md``), so speculation
changes the speed and nothing else. ``p`` is what the plain sampler samples
from: penalties, temperature, min-p, top-k, top-p
(:mod:`minivllm.ref.sampler`), at every position.

Randomness: one ``U[0, 1)`` per draft and one ``Exp(1)`` vector per request
(:func:`~minivllm.spec_decode.metadata.draw_rejection_randomness`). "Accept
with probability a" is ``u < a``, written ``u * q(x) < p(x)`` so that no
division is rounded (and a draft with ``p(x) = 0`` is never kept); a token
from weights ``w`` is the exponential race ``argmax(w / e)``, which needs no
normalisation. Seeded requests stay reproducible whatever else is in the batch.

This twin goes one request and one position at a time, as the rule reads.
``minivllm/fast/rejection_sampler.py`` does all of them at once and emits the
same tokens.
"""

from __future__ import annotations

import torch

from minivllm.ref.sampler import apply_penalties, filter_logits
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.spec_decode.metadata import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSamplerOutput,
    SpecDecodeMetadata,
    check_inputs,
    draw_rejection_randomness,
    expand_sampling_metadata,
)


def rejection_sample(
    target_logits: torch.Tensor,
    spec_metadata: SpecDecodeMetadata,
    draft_probs: torch.Tensor | None,
    sampling_metadata: SamplingMetadata,
) -> RejectionSamplerOutput:
    """Verify one step's drafts against the target; the input is not modified.

    Args:
        target_logits: (num_draft_tokens + B, V) raw target logits, request
            ``i``'s ``k_i + 1`` rows together (row ``j`` follows drafts ``0..j-1``).
        spec_metadata: the drafts (:class:`SpecDecodeMetadata`).
        draft_probs: (num_draft_tokens, V) float32, the distribution each
            draft was sampled from, or None when the proposer gives none (n-gram).
        sampling_metadata: the B requests' sampling parameters and generators,
            as built for the plain sampler (one row per request).

    Returns:
        :class:`RejectionSamplerOutput`: per request the accepted drafts plus
        one recovered or bonus token, and the number accepted.
    """
    check_inputs(target_logits, spec_metadata, draft_probs, sampling_metadata)
    per_position = expand_sampling_metadata(sampling_metadata, spec_metadata)
    logits = apply_penalties(target_logits.to(torch.float32).clone(), per_position)  # (T, V)
    target_probs = None
    if not sampling_metadata.all_greedy:
        target_probs = torch.softmax(filter_logits(logits, per_position), dim=-1)  # (T, V)
    uniform, exponentials = draw_rejection_randomness(sampling_metadata, spec_metadata)

    num_requests = spec_metadata.num_requests
    output = torch.full((num_requests, spec_metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int64)
    num_accepted = torch.zeros(num_requests, dtype=torch.int64)
    greedy = sampling_metadata.greedy_mask.tolist()
    row = draft = 0  # the request's first logits row and first draft
    for i, drafts in enumerate(spec_metadata.draft_token_ids_cpu):
        k = len(drafts)
        if greedy[i]:
            target_argmax = logits[row : row + k + 1].argmax(dim=-1).tolist()
            tokens = verify_greedy(drafts, target_argmax)
        else:
            tokens = verify_random(
                drafts,
                target_probs[row : row + k + 1],
                None if draft_probs is None else draft_probs[draft : draft + k],
                uniform[draft : draft + k],
                exponentials[i],
            )
        output[i, : len(tokens)] = torch.tensor(tokens)
        num_accepted[i] = len(tokens) - 1
        row, draft = row + k + 1, draft + k
    device = target_logits.device
    return RejectionSamplerOutput(output_token_ids=output.to(device),
                                  num_accepted_tokens=num_accepted.to(device))


def verify_greedy(draft_token_ids: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy verification: keep drafts while they equal the target's argmax.

    Args:
        draft_token_ids: the request's ``k`` drafts.
        target_argmax: ``k + 1`` ids, the target's argmax at each position.

    Returns:
        The accepted drafts, then the target's argmax at the first mismatch
        (or at position ``k`` if none): between 1 and ``k + 1`` tokens, exactly
        what ``k + 1`` steps of greedy decoding would emit.
    """
    # BEGIN SOLUTION
    tokens = []
    for draft, target in zip(draft_token_ids, target_argmax):
        tokens.append(target)
        if draft != target:
            return tokens
    tokens.append(target_argmax[len(draft_token_ids)])
    return tokens
    # END SOLUTION


def verify_random(
    draft_token_ids: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    exponentials: torch.Tensor,
) -> list[int]:
    """The Leviathan et al. rule for one request with ``k`` drafts.

    Args:
        draft_token_ids: the ``k`` drafts.
        target_probs: (k + 1, V) float32, ``p`` at each position.
        draft_probs: (k, V) float32, ``q`` at each draft, or None: one-hot on the draft.
        uniform: (k,) float32 in ``[0, 1)``, one per draft.
        exponentials: (V,) float32 ``Exp(1)``, for the one extra token.

    Returns:
        The accepted drafts, then one token from ``norm(max(p - q, 0))`` at
        the first rejection, or from ``p`` at position ``k`` if all were accepted.
        If ``max(p - q, 0)`` is all zero (only when ``p == q`` and the draft had
        ``q(x) = 0``), the token comes from ``p``.
    """
    # BEGIN SOLUTION
    vocab_size = target_probs.shape[1]
    for j, x in enumerate(draft_token_ids):
        p = target_probs[j]  # (V,)
        if draft_probs is None:
            q = torch.zeros(vocab_size, dtype=torch.float32, device=p.device)
            q[x] = 1.0
        else:
            q = draft_probs[j]  # (V,)
        # Accept with probability min(1, p(x) / q(x)): u < p(x) / q(x), undivided.
        # Both sides stay float32 tensors so the fast twin rounds identically.
        if uniform[j] * q[x] < p[x]:
            continue
        residual = torch.clamp(p - q, min=0)  # (V,); norm() is implicit in the race
        if not (residual > 0).any():
            residual = p
        recovered = int((residual / exponentials).argmax())
        return list(draft_token_ids[:j]) + [recovered]
    bonus = int((target_probs[len(draft_token_ids)] / exponentials).argmax())
    return list(draft_token_ids) + [bonus]
    # END SOLUTION
