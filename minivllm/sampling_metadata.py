"""``SamplingMetadata``: one step's sampling parameters as per-row tensors.

The model runner builds one of these per step with
:meth:`SamplingMetadata.from_requests` (row ``i`` is ``requests[i]``) and hands
it to the sampler (``backend.get("sampler").sample(logits, metadata)``). Both
sampler twins read the same metadata and return the same
:class:`SamplerOutput`, so this module also holds what they share: the
output types and :func:`draw_exponentials`, the one place randomness is drawn.

Building runs every decode step, so it stays cheap: one pass over the requests
to collect Python scalars, one tensor per field, and the tensors a stage needs
only when some row uses that stage (``None`` otherwise, and the sampler skips
the stage). Names follow vLLM v1 (``vllm/v1/sample/metadata.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.request import Request
from minivllm.sampling_params import _SAMPLING_EPS


@dataclass
class LogprobsTensors:
    """Logprobs of one step, as in vLLM v1.

    Column 0 is the sampled token; columns ``1..K`` are the ``K =
    max_num_logprobs`` most likely tokens, best first. Rows that asked for
    fewer than ``K`` simply ignore the extra columns.

    Attributes:
        logprob_token_ids: (N, K + 1) int64 token ids.
        logprobs: (N, K + 1) float32 log-probabilities (raw model distribution).
        selected_token_ranks: (N,) int64 rank of the sampled token: the number
            of tokens whose logprob is at least the sampled token's (1 = best).
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """What the sampler returns for one step.

    Attributes:
        sampled_token_ids: (N,) int64, one new token per row.
        logprobs: :class:`LogprobsTensors`, or None when no row asked for logprobs.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters for a batch of ``N`` rows and a vocabulary of ``V``.

    A stage's tensors are ``None`` when no row uses it, which tells the sampler
    to skip the stage. Disabled rows inside a used stage hold a neutral value
    (``top_k = V``, ``top_p = 1``, ``min_p = 0``, penalties off).

    Attributes:
        temperature: (N,) float32; greedy rows hold their requested value (< eps).
        all_greedy: every row is greedy (no random work at all).
        all_random: no row is greedy (no argmax pass needed).
        top_k: (N,) int64 in ``[1, V]``, or None.
        max_top_k: the largest ``top_k`` of the random rows that use top-k, as
            a Python int (so a twin can call ``torch.topk`` without a device
            sync), or 0 when top_k is None.
        top_p: (N,) float32 in ``(0, 1]``, or None.
        min_p: (N,) float32 in ``[0, 1]``, or None.
        generator: the engine's generator for unseeded random rows (None: torch's
            default generator for the device).
        generators: row index -> that request's own generator, for seeded random rows.
        unseeded_rows: random rows without a seed, ascending (kept on the host so
            drawing needs no device sync).
        presence_penalties / frequency_penalties: (N,) float32, or None when
            every row has 0.
        repetition_penalties: (N,) float32, or None when every row has 1.
        prompt_token_ids: (N, P) int64, prompts right-padded with ``V``; only
            when repetition penalties are used (the only penalty that sees the prompt).
        output_token_ids: (N, O) int64, outputs right-padded with ``V``; when
            any penalty is used.
        min_tokens_rows / min_tokens_ids: (M,) int64 pairs ``(row, token id)``
            whose logit is set to ``-inf`` (EOS and stop ids of rows that have
            not yet produced ``min_tokens`` tokens), or None.
        max_num_logprobs: the largest ``logprobs`` asked for (at most V), or None
            when no row asked.
        vocab_size: ``V``.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    max_top_k: int
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generator: torch.Generator | None
    generators: dict[int, torch.Generator]
    unseeded_rows: list[int]
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    min_tokens_rows: torch.Tensor | None
    min_tokens_ids: torch.Tensor | None
    max_num_logprobs: int | None
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def no_penalties(self) -> bool:
        """True when no row uses any penalty."""
        return self.output_token_ids is None

    @property
    def greedy_mask(self) -> torch.Tensor:  # (N,) bool
        """Rows that take the argmax instead of sampling."""
        return self.temperature < _SAMPLING_EPS

    @classmethod
    def from_requests(
        cls,
        requests: list[Request],
        vocab_size: int,
        device: torch.device | str,
        generator: torch.Generator | None = None,
        seeded_generators: dict[str, torch.Generator] | None = None,
    ) -> SamplingMetadata:
        """Build the metadata for ``requests`` (row ``i`` is ``requests[i]``).

        Args:
            requests: the requests that sample a token this step, in row order.
            vocab_size: ``V``, the width of the logits.
            device: where the logits live.
            generator: the engine's generator for unseeded random rows.
            seeded_generators: the engine's ``request_id -> Generator`` store for
                seeded requests. A seeded request missing from it gets a new
                generator seeded with ``sampling_params.seed``, stored there; the
                engine keeps the dict across steps and drops finished requests.
                Because a request's generator only advances when that request
                samples, its tokens do not depend on what else is in the batch.
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
        params = [r.sampling_params for r in requests]
        temperature = [p.temperature for p in params]
        greedy = [p.greedy for p in params]

        # Filters only matter for random rows; greedy rows get neutral values.
        top_k = [
            vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size)
            for p, g in zip(params, greedy)
        ]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        used_top_k = [k for k in top_k if k < vocab_size]
        use_top_k = bool(used_top_k)
        use_top_p = any(p < 1.0 for p in top_p)
        use_min_p = any(p > 0.0 for p in min_p)

        generators: dict[int, torch.Generator] = {}
        for i, (r, g) in enumerate(zip(requests, greedy)):
            if g or r.sampling_params.seed is None:
                continue
            if seeded_generators is None:
                raise ValueError(
                    f"request {r.request_id!r} has a seed: pass seeded_generators "
                    "(a dict the engine keeps across steps)"
                )
            gen = seeded_generators.get(r.request_id)
            if gen is None:
                gen = torch.Generator(device=device)
                gen.manual_seed(r.sampling_params.seed)
                seeded_generators[r.request_id] = gen
            generators[i] = gen

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        use_presence = any(x != 0.0 for x in presence)
        use_frequency = any(x != 0.0 for x in frequency)
        use_repetition = any(x != 1.0 for x in repetition)
        use_penalties = use_presence or use_frequency or use_repetition

        # min_tokens: (row, token id) pairs to suppress, as vLLM's
        # MinTokensLogitsProcessor does (EOS and every stop token id).
        mt_rows: list[int] = []
        mt_ids: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids)
                if r.eos_token_id is not None:
                    ids.add(r.eos_token_id)
                ids = [t for t in ids if 0 <= t < vocab_size]
                mt_rows.extend([i] * len(ids))
                mt_ids.extend(ids)

        asked = [p.logprobs for p in params if p.logprobs is not None]

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            temperature=f32(temperature),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=i64(top_k) if use_top_k else None,
            max_top_k=max(used_top_k) if use_top_k else 0,
            top_p=f32(top_p) if use_top_p else None,
            min_p=f32(min_p) if use_min_p else None,
            generator=generator,
            generators=generators,
            unseeded_rows=[i for i, g in enumerate(greedy) if not g and i not in generators],
            presence_penalties=f32(presence) if use_presence else None,
            frequency_penalties=f32(frequency) if use_frequency else None,
            repetition_penalties=f32(repetition) if use_repetition else None,
            prompt_token_ids=(
                pad_token_ids([r.prompt_token_ids for r in requests], vocab_size, device)
                if use_repetition
                else None
            ),
            output_token_ids=(
                pad_token_ids([r.output_token_ids for r in requests], vocab_size, device)
                if use_penalties
                else None
            ),
            min_tokens_rows=i64(mt_rows) if mt_rows else None,
            min_tokens_ids=i64(mt_ids) if mt_rows else None,
            max_num_logprobs=min(max(asked), vocab_size) if asked else None,
            vocab_size=vocab_size,
        )


def pad_token_ids(
    rows: list[list[int]], pad: int, device: torch.device | str
) -> torch.Tensor:  # (N, max_len) int64
    """Right-pad ragged lists of ids with ``pad`` into one tensor.

    NumPy copies each list in one C-level slice assignment (a loop over
    requests, not tokens); this measured several times faster than building
    the same tensor with torch index arithmetic (``repeat_interleave`` +
    scatter), whose small-op overheads dominate at these sizes. Rows with no
    ids are all ``pad``; the result has at least one column so that later
    scatters never see width 0.
    """
    max_len = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(max_len, 1)), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)


def draw_exponentials(metadata: SamplingMetadata, vocab_size: int) -> torch.Tensor:
    """Draw ``q ~ Exp(1)`` of shape (N, V): the only randomness of a sampling step.

    Both sampler twins sample ``argmax(probs / q)`` (the *exponential race*:
    ``P(argmax_i p_i / q_i = j) = p_j``), and both get ``q`` from here, so they
    pick the same tokens.

    - A seeded random row draws one (V,) vector from its own generator. Nothing
      else touches that generator, so the row's tokens are the same whatever
      else is in the batch and wherever the row sits.
    - Unseeded random rows draw one (num_unseeded, V) block from the engine's
      shared generator, rows in batch order (on CPU that equals one draw per row).
    - Greedy rows draw nothing and hold 1.

    Each ``Exp(1)`` is the textbook inverse transform of a uniform draw,
    ``q = -log(1 - u)`` with ``u ~ U[0, 1)`` (:func:`exponential_from_uniform_`).
    ``Tensor.exponential_`` gives the same distribution, but on a CPU it runs
    one element at a time: 57-62 ms for a batch of 64 x 49,152 (SmolLM2's
    vocabulary) against 10-11 ms for ``uniform_`` and a vectorised ``log1p``,
    and 0.9 against 0.2 ms at batch 1, a tenth of an int8 decode step.

    ``u = 0`` gives ``q = 0``, and ``0 / 0`` would be NaN, which ``argmax``
    picks; clamping to the smallest positive float keeps a filtered token
    (probability 0) from ever winning.
    """
    num_rows = metadata.num_rows
    device = metadata.temperature.device
    q = torch.ones(num_rows, vocab_size, dtype=torch.float32, device=device)  # (N, V)
    if metadata.all_greedy:
        return q
    unseeded = metadata.unseeded_rows
    if unseeded:
        block = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
        q[unseeded] = exponential_from_uniform_(block, metadata.generator)
    for row, gen in metadata.generators.items():
        exponential_from_uniform_(q[row], gen)
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


def exponential_from_uniform_(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``out`` in place with ``Exp(1)`` draws: ``-log(1 - u)``, ``u ~ U[0, 1)``.

    ``P(-log(1 - u) > t) = P(u < 1 - e^-t) = e^-t``: the exponential's tail.
    ``log1p(-u)`` keeps the small draws (small ``u``) exact, and those are the
    ones that decide an exponential race.
    """
    return out.uniform_(generator=generator).neg_().log1p_().neg_()
