"""The engine's sampling step: logits in, each request's new tokens out.

Rank 0 alone samples. For the requests that sample this step (in batch
order; a request verifying ``d`` drafts owns ``1 + d`` logits rows), the
logits processors shape the logits first (``logit_bias``, ``allowed_token_ids``,
``bad_words``, custom ones: :mod:`.logits_shaping`); then

- without drafts, the ``sampler`` component draws one token per row;
- with drafts (speculative decoding), the ``rejection_sampler`` component
  verifies them and emits the accepted ones plus one more (a row without
  drafts gets exactly the plain sampler's token);

with each request's own generator when it has a seed, and the engine's shared
one otherwise. :meth:`StepSampler.sample` returns, per request, the tokens it
emitted and their logprob rows. Logprobs are of the logits before shaping
(vLLM's default, ``raw_logprobs``).

**One bad request hurts no one else.** If the batched call raises, each
request is sampled alone, from the generator state it had before, to find the
ones the failure belongs to (:func:`_isolate`, the one fallback both paths
use); those are reported as failed and the others get their tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minivllm import backend
from minivllm.engine.logits_shaping import LogitsShaper
from minivllm.logits_processor import LogitsProcessor, LogitsProcessorConfig
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.spec_decode.metadata import SpecDecodeMetadata, SpecStats

#: One sampled request: (request, emitted tokens, logprob rows ``(ids, vals, rank)`` or None).
Row = tuple[Request, list[int], list[tuple] | None]


class StepSampler:
    """Turns one step's logits into tokens (see the module docstring).

    Args:
        components: the engine's components (``sampler``, ``rejection_sampler``).
        vocab_size: the model's vocabulary size.
        device: where the logits and the generators live (rank 0's device).
        seed: seed of the generator shared by requests without their own seed.
        num_speculative_tokens: ``k`` of speculative decoding (0 without it):
            the length of the per-position acceptance counts.
        logits_processors: custom processor classes (``LLM(logits_processors=...)``).
        max_num_seqs: the most requests running at once (the processors are told).
    """

    def __init__(self, components: backend.Components, vocab_size: int, device: torch.device,
                 seed: int = 0, num_speculative_tokens: int = 0,
                 logits_processors: tuple[type[LogitsProcessor], ...] = (),
                 max_num_seqs: int = 256) -> None:
        self.shaper = LogitsShaper(
            components.logits_processors, logits_processors,
            LogitsProcessorConfig(vocab_size, max_num_seqs, num_speculative_tokens), device)
        self.sampler = components.sampler
        self.rejection_sampler = components.rejection_sampler
        self.vocab_size = vocab_size
        self.device = device
        self.num_speculative_tokens = num_speculative_tokens
        # Requests without a seed share one generator; seeded ones get their own,
        # advanced only when that request samples.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeded_generators: dict[str, torch.Generator] = {}
        #: The ``q`` rows of each request's drafts awaiting verification (a draft model's).
        self.draft_probs: dict[str, torch.Tensor] = {}

    # -- per request ------------------------------------------------------------------

    def make_generator(self, request: Request) -> torch.Generator | None:
        """The request's own generator if it has a seed (built, not yet stored).

        The engine builds it before the scheduler sees the request, so that a
        seed torch refuses fails the request's add, not a later step.
        """
        seed = request.sampling_params.seed
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def add_request(self, request: Request, generator: torch.Generator | None) -> None:
        """Keep the request's own generator (from :meth:`make_generator`)."""
        if generator is not None:
            self.seeded_generators[request.request_id] = generator

    def remove_request(self, request_id: str) -> None:
        """Forget a finished request's generator and drafts; its processors' state."""
        self.seeded_generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        self.shaper.remove_request(request_id)

    # -- one step ---------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, reqs: list[Request],
               drafts: list[tuple[int, ...]]
               ) -> tuple[list[Row], list[tuple[Request, Exception]], SpecStats]:
        """Sample (or verify) every request of ``reqs``: ``(rows, failures, spec counts)``.

        ``logits`` holds ``1 + len(drafts[i])`` rows for ``reqs[i]``, in order.
        """
        if not reqs:
            return [], [], SpecStats()
        try:
            shaped, dead = self.shaper.apply(logits, reqs, drafts)
        except Exception as e:  # noqa: BLE001 -- a processor failed: the step's requests
            self.draft_probs = {}
            return [], [(r, e) for r in reqs], SpecStats()
        raw = None if shaped is logits else logits  # kept for the logprobs
        if dead:
            shaped, raw, reqs, drafts = _drop(shaped, raw, reqs, drafts, dead)
        fn = self._verify if any(drafts) else self._sample_plain
        rows, failures = _isolate(fn, shaped, raw, reqs, drafts, self.seeded_generators)
        failures = dead + failures
        self.draft_probs = {}  # verified (or dropped) this step
        done = {id(r) for r, _ in failures}
        kept = [(r, d) for r, d in zip(reqs, drafts) if id(r) not in done]
        return rows, failures, _count([d for _, d in kept], [t for _, t, _ in rows],
                                      self.num_speculative_tokens)

    def _metadata(self, reqs: list[Request]) -> SamplingMetadata:
        return SamplingMetadata.from_requests(reqs, self.vocab_size, self.device,
                                              self.generator, self.seeded_generators)

    def _sample_plain(self, logits: torch.Tensor, raw: torch.Tensor | None,
                      reqs: list[Request], drafts: list[tuple[int, ...]]) -> list[Row]:
        """The sampler component, one token per row (``raw``: the logits before shaping,
        None if none was done)."""
        metadata = self._metadata(reqs)
        out = self.sampler.sample(logits, metadata)
        tokens = out.sampled_token_ids.tolist()
        lp = out.logprobs
        if lp is None:
            return [(r, [t], None) for r, t in zip(reqs, tokens)]
        if raw is not None:  # the logprobs of the unshaped logits, as vLLM returns them
            lp = self.sampler.gather_logprobs(torch.log_softmax(raw.to(torch.float32), dim=-1),
                                              out.sampled_token_ids, metadata.max_num_logprobs)
        rows = zip(lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                   lp.selected_token_ranks.tolist())
        return [(r, [t], [row]) for r, t, row in zip(reqs, tokens, rows)]

    def _verify(self, logits: torch.Tensor, raw: torch.Tensor | None, reqs: list[Request],
                drafts: list[tuple[int, ...]]) -> list[Row]:
        """The rejection sampler component over the batch: emitted tokens and logprob rows
        (those from ``raw``, the logits before shaping, when there was some)."""
        metadata = self._metadata(reqs)
        spec = SpecDecodeMetadata.make([list(d) for d in drafts], self.vocab_size,
                                       logits.device)
        out = self.rejection_sampler.rejection_sample(
            logits, spec, self._draft_probs(reqs, drafts), metadata)
        tokens = out.parse_output()
        logprobs = self._logprobs(logits if raw is None else raw, drafts, tokens, metadata)
        return [(r, t, p) for r, t, p in zip(reqs, tokens, logprobs)]

    def _draft_probs(self, reqs: list[Request],
                     drafts: list[tuple[int, ...]]) -> torch.Tensor | None:
        """The scheduled drafts' ``q`` rows, stacked; None for one-hot (n-gram) drafts."""
        probs = [self.draft_probs[r.request_id][: len(d)]
                 for r, d in zip(reqs, drafts) if d and r.request_id in self.draft_probs]
        if not probs:
            return None
        if len(probs) != sum(1 for d in drafts if d):
            raise ValueError("draft_probs are missing for some requests with drafts")
        return torch.cat(probs).to(torch.float32)

    def _logprobs(self, logits: torch.Tensor, drafts: list[tuple[int, ...]],
                  tokens: list[list[int]], metadata: SamplingMetadata) -> list:
        """Per request, one logprob row per emitted token, from the target's raw logits
        at that position (what the plain sampler returns); None rows if none asked."""
        if metadata.max_num_logprobs is None:
            return [None] * len(tokens)
        rows, ids, start = [], [], 0
        for d, t in zip(drafts, tokens):
            rows += range(start, start + len(t))
            ids += t
            start += len(d) + 1
        raw = torch.log_softmax(logits[rows].to(torch.float32), dim=-1)  # (emitted, V)
        lp = self.sampler.gather_logprobs(raw, torch.tensor(ids, device=raw.device),
                                          metadata.max_num_logprobs)
        flat = list(zip(lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                        lp.selected_token_ranks.tolist()))
        out, at = [], 0
        for t in tokens:
            out.append(flat[at : at + len(t)])
            at += len(t)
        return out


def _drop(logits: torch.Tensor, raw: torch.Tensor | None, reqs: list[Request],
          drafts: list[tuple[int, ...]], dead: list[tuple[Request, Exception]]):
    """``logits``, ``raw``, ``reqs`` and ``drafts`` without the ``dead`` requests' rows."""
    gone = {id(r) for r, _ in dead}
    keep, kept, start = [], [], 0
    for r, d in zip(reqs, drafts):
        if id(r) not in gone:
            keep += range(start, start + len(d) + 1)
            kept.append((r, d))
        start += len(d) + 1
    return (logits[keep], None if raw is None else raw[keep],
            [r for r, _ in kept], [d for _, d in kept])


def _isolate(fn: Callable[..., list[Row]], logits: torch.Tensor, raw: torch.Tensor | None,
             reqs: list[Request], drafts: list[tuple[int, ...]],
             generators: dict[str, torch.Generator]
             ) -> tuple[list[Row], list[tuple[Request, Exception]]]:
    """``fn(logits, raw, reqs, drafts)``; if it raises, each request alone, to find whose
    failure it is (``raw``: the logits before shaping, or None).

    Each request is retried from the generator state it had before the batched
    call, so the survivors' tokens are the ones they would have drawn anyway
    (a seeded request's stream does not depend on the batch).
    """
    seeded = {r.request_id: generators[r.request_id].get_state()
              for r in reqs if r.request_id in generators}
    try:
        return fn(logits, raw, reqs, drafts), []
    except Exception:  # noqa: BLE001 -- find whose it is, below
        pass
    rows: list[Row] = []
    failures: list[tuple[Request, Exception]] = []
    start = 0
    for req, d in zip(reqs, drafts):
        mine = slice(start, start + len(d) + 1)
        start += len(d) + 1
        if req.request_id in seeded:
            generators[req.request_id].set_state(seeded[req.request_id])
        try:
            rows += fn(logits[mine], None if raw is None else raw[mine], [req], [d])
        except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
            failures.append((req, e))
    return rows, failures


def _count(drafts: Sequence[tuple[int, ...]], tokens: Sequence[list[int]], k: int) -> SpecStats:
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
