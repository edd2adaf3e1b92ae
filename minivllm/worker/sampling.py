"""The worker's sampling step: logits in, each request's new tokens out.

The sampling worker (the last pipeline stage's tensor-parallel rank 0) alone
samples, as the engine's :class:`~minivllm.step_sampling.SamplingPlan` says
(:meth:`StepSampler.run`). It keeps what it needs of each request that samples
(:class:`CachedRequestState`: parameters, prompt, outputs, generator), told of
new requests, new tokens and finished ones by the plan. Per step: the prompt-
logprob rows are scored and set aside, siblings of ``n > 1`` copy their
source's row, beams take their top ``k`` log-probabilities, and the grammar
bitmask masks the constrained rows. For the requests that sample (in batch
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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm import backend
from minivllm.logits_processor import LogitsProcessor, LogitsProcessorConfig
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metadata import SpecDecodeMetadata, SpecStats, count_verified
from minivllm.step_sampling import ModelRunnerOutput, PromptLogprobs, SamplingPlan
from minivllm.worker.logits_shaping import LogitsShaper


@dataclass
class CachedRequestState:
    """What the sampling worker keeps of a request that samples (vLLM's name): read by
    the sampler's metadata, the logits processors and the penalties."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


#: One sampled request: (request, emitted tokens, logprob rows ``(ids, vals, rank)`` or None).
Row = tuple[CachedRequestState, list[int], list[tuple] | None]


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
        self.structured = components.structured_output  # applies the grammar bitmask
        self.requests: dict[str, CachedRequestState] = {}  # those that sample, by id
        # Requests without a seed share one generator; seeded ones get their own,
        # advanced only when that request samples.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeded_generators: dict[str, torch.Generator] = {}
        #: The ``q`` rows of each request's drafts awaiting verification (a draft
        #: model's, set by the worker's speculator when it proposes).
        self.draft_probs: dict[str, torch.Tensor] = {}

    # -- the requests it samples ------------------------------------------------------

    def update_states(self, plan: SamplingPlan) -> None:
        """Apply the plan's news: forgotten requests go, new ones come, tokens append.

        Forgotten ones go first (an id may be reused by a new request at once).
        """
        for request_id in plan.finished_req_ids:
            self.remove_request(request_id)
        for new in plan.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids), list(new.output_token_ids),
                new.sampling_params, new.eos_token_id, new.max_tokens)
        for request_id, tokens in plan.new_token_ids:
            self.requests[request_id].output_token_ids.extend(tokens)

    def remove_request(self, request_id: str) -> None:
        """Forget a finished request: its state, generator, drafts and processors' state."""
        self.requests.pop(request_id, None)
        self.seeded_generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        self.shaper.remove_request(request_id)

    # -- one step, as planned ---------------------------------------------------------

    def run(self, logits: torch.Tensor, plan: SamplingPlan) -> ModelRunnerOutput:
        """Everything the plan asks of this step's ``(num_logits, V)`` logits."""
        prompt, logits = self._prompt_logprobs(logits, plan)
        reqs, drafts, ranked, rows = [], [], {}, []
        beams = {rid: (k, t) for rid, k, t in plan.ranked}
        last_row, start = {}, 0
        for rid, d in zip(plan.req_ids, plan.drafts):
            last_row[rid] = start + len(d)
            if rid in beams:  # a beam ranks its candidates: nothing is sampled
                ranked[rid] = self._rank(logits[start : start + 1], rid, *beams[rid], plan)
            elif rid not in plan.skipped:
                reqs.append(self.requests[rid])
                drafts.append(tuple(d))
                rows += range(start, start + len(d) + 1)
            start += len(d) + 1
        for sibling, source in plan.fan_out:  # n > 1: the same row, its own generator
            if sibling in plan.skipped:
                continue
            reqs.append(self.requests[sibling])
            drafts.append(())
            rows.append(last_row[source])
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[rows]
        if plan.grammar_bitmask is not None:
            self._mask(logits, reqs, plan)
        sampled, failures, _ = self.sample(logits, reqs, drafts)
        for r, tokens, _ in sampled:  # the worker's copy takes what it emitted at once
            r.output_token_ids.extend(tokens)
        return ModelRunnerOutput(
            req_ids=tuple(r.request_id for r, _, _ in sampled),
            sampled_token_ids=tuple(tuple(t) for _, t, _ in sampled),
            logprobs=tuple(lp for _, _, lp in sampled), prompt_logprobs=tuple(prompt),
            ranked=ranked, failures=tuple((r.request_id, e) for r, e in failures))

    def _rank(self, row: torch.Tensor, rid: str, k: int, temperature: float,
              plan: SamplingPlan) -> tuple[list[float], list[int]]:
        """A beam's candidates from its ``(1, V)`` row: its grammar's mask first (a
        constrained beam), then the top ``k`` log-probabilities, the allowed ones only."""
        if rid in plan.skipped:  # its grammar allows nothing: it offers no candidate
            return [], []
        if rid in plan.bitmask_req_ids:
            row = row.to(torch.float32, copy=True)
            self._mask(row, [self.requests.get(rid) or _Beam(rid)], plan)
        values, ids = _top_logprobs(row[0], k, temperature)
        keep = [i for i, v in enumerate(values) if v != float("-inf")]
        return [values[i] for i in keep], [ids[i] for i in keep]

    def _mask(self, logits: torch.Tensor, reqs: list, plan: SamplingPlan) -> None:
        """The grammar bitmask on its requests' rows (constrained requests have no drafts)."""
        row_of = {r.request_id: i for i, r in enumerate(reqs)}
        pairs = [(row_of[rid], i) for i, rid in enumerate(plan.bitmask_req_ids)
                 if rid in row_of]
        if not pairs:
            return
        rows = torch.tensor([r for r, _ in pairs], device=logits.device)
        bitmask = plan.grammar_bitmask.new_full((logits.shape[0], plan.grammar_bitmask.shape[1]),
                                                -1)  # (B, W): every row, the masked ones set
        bitmask[rows.cpu()] = plan.grammar_bitmask[[i for _, i in pairs]]
        bitmask = bitmask.to(logits.device)
        with torch.inference_mode():  # the logits were made in inference mode
            self.structured.apply_token_bitmask_inplace(logits, bitmask, rows)

    def _prompt_logprobs(self, logits: torch.Tensor, plan: SamplingPlan
                         ) -> tuple[list[PromptLogprobs], torch.Tensor]:
        """Score the prompt-logprob rows (row ``i`` of a run scores prompt token
        ``first_position + i + 1``); return them and the other rows."""
        if not plan.prompt_logprob_rows:
            return [], logits
        out, keep = [], torch.ones(logits.shape[0], dtype=torch.bool)
        for rid, first_position, first_row, count in plan.prompt_logprob_rows:
            keep[first_row : first_row + count] = False
            state = self.requests[rid]
            targets = state.prompt_token_ids[first_position + 1 : first_position + 1 + count]
            raw = torch.log_softmax(
                logits[first_row : first_row + len(targets)].to(torch.float32), dim=-1)
            lp = self.sampler.gather_logprobs(raw, torch.tensor(targets, device=raw.device),
                                              plan.prompt_logprobs[rid])
            out.append(PromptLogprobs(rid, first_position, tuple(zip(
                lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                lp.selected_token_ranks.tolist()))))
        return out, logits[keep.to(logits.device)]

    # -- one step ---------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, reqs: list[CachedRequestState],
               drafts: list[tuple[int, ...]]
               ) -> tuple[list[Row], list[tuple[CachedRequestState, Exception]], SpecStats]:
        """Sample (or verify) every request of ``reqs``: ``(rows, failures, spec counts)``.

        ``logits`` holds ``1 + len(drafts[i])`` rows for ``reqs[i]``, in order.
        """
        if not reqs:
            return [], [], SpecStats()
        try:
            shaped, dead = self.shaper.apply(logits, reqs, drafts)
        except Exception as e:  # noqa: BLE001 -- a processor failed: the step's requests
            self._drop_draft_probs(reqs)
            return [], [(r, e) for r in reqs], SpecStats()
        raw = None if shaped is logits else logits  # kept for the logprobs
        if dead:
            shaped, raw, reqs, drafts = _drop(shaped, raw, reqs, drafts, dead)
        fn = self._verify if any(drafts) else self._sample_plain
        rows, failures = _isolate(fn, shaped, raw, reqs, drafts, self.seeded_generators)
        failures = dead + failures
        self._drop_draft_probs(reqs)  # verified (or dropped) this step
        done = {id(r) for r, _ in failures}
        kept = [(r, d) for r, d in zip(reqs, drafts) if id(r) not in done]
        return rows, failures, count_verified([d for _, d in kept], [t for _, t, _ in rows],
                                              self.num_speculative_tokens)

    def _drop_draft_probs(self, reqs: list[CachedRequestState]) -> None:
        """The ``q`` rows of requests that just sampled are spent (verified, or their
        drafts were not scheduled); those of requests not in the step wait for theirs."""
        for r in reqs:
            self.draft_probs.pop(r.request_id, None)

    def _metadata(self, reqs: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.from_requests(reqs, self.vocab_size, self.device,
                                              self.generator, self.seeded_generators)

    def _sample_plain(self, logits: torch.Tensor, raw: torch.Tensor | None,
                      reqs: list[CachedRequestState], drafts: list[tuple[int, ...]]) -> list[Row]:
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

    def _verify(self, logits: torch.Tensor, raw: torch.Tensor | None, reqs: list[CachedRequestState],
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

    def _draft_probs(self, reqs: list[CachedRequestState],
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


def _drop(logits: torch.Tensor, raw: torch.Tensor | None, reqs: list[CachedRequestState],
          drafts: list[tuple[int, ...]], dead: list[tuple[CachedRequestState, Exception]]):
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
             reqs: list[CachedRequestState], drafts: list[tuple[int, ...]],
             generators: dict[str, torch.Generator]
             ) -> tuple[list[Row], list[tuple[CachedRequestState, Exception]]]:
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
    failures: list[tuple[CachedRequestState, Exception]] = []
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


@dataclass
class _Beam:
    """A beam, as :meth:`StepSampler._mask` reads it (it keeps no state here)."""

    request_id: str


def _top_logprobs(row: torch.Tensor, k: int, temperature: float
                  ) -> tuple[list[float], list[int]]:
    """A beam's candidates: the top ``k`` of ``log_softmax(row / temperature)``."""
    row = row.float()
    logprobs = torch.log_softmax(row / temperature if temperature > 0 else row, dim=-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return values.tolist(), ids.tolist()
