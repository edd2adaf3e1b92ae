"""The speculative part of an engine step: verify last step's drafts, propose the next ones.

With a ``speculative_config`` the engine step reads (``LLMEngine._run_step``)::

    scheduler.schedule()        # a decode with d drafts: 1 + d query tokens
    runner.prepare_inputs()     # logits rows at all 1 + d positions
    executor.execute_model()    # every rank; the drafts are just input tokens
    spec.sample(...)            # rejection_sample over the whole batch (k = 0 rows:
                                # plain sampling, token for token)
    scheduler.update_from_output()  # append, stop rules per token, roll back
    spec.propose(...)           # new drafts on request.spec_token_ids

:class:`SpecDecoder` holds what persists between steps: the proposer, the
back-off (:mod:`.backoff`) and the draft probabilities of the drafts waiting
to be verified. Rank 0 alone runs it, as it alone samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minivllm import backend
from minivllm.metadata import SchedulerOutput
from minivllm.ref.sampler import gather_logprobs
from minivllm.request import Request, RequestStatus
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.spec_decode.backoff import BackOff
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.spec_decode.proposer import Proposer, make_proposer

#: One sampled request: (request, emitted tokens, logprob rows ``(ids, vals, rank)`` or None).
Row = tuple[Request, list[int], list[tuple] | None]


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


class SpecDecoder:
    """Speculative decoding for one engine (rank 0).

    Args:
        config: the engine's :class:`SpeculativeConfig`.
        components: the engine's components (``rejection_sampler``, and
            ``ngram_proposer`` for the n-gram proposer).
        vocab_size: the model's vocabulary size.
        max_model_len: drafts never reach past it.
        proposer: who proposes; None builds the one ``config.method`` names.
    """

    def __init__(self, config: SpeculativeConfig, components: backend.Components,
                 vocab_size: int, max_model_len: int, proposer: Proposer | None = None,
                 executor=None) -> None:
        self.config = config
        self.rejection_sampler = components.rejection_sampler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config, components, executor)
        self.backoff = BackOff()
        self.draft_probs: dict[str, torch.Tensor] = {}  # (d, V) per request with drafts

    # -- verification ---------------------------------------------------------------

    def sample(self, runner, logits: torch.Tensor, reqs: list[Request],
               scheduler_output: SchedulerOutput, step: int,
               fail: Callable[[Request, Exception], None]) -> tuple[list[Row], SpecStats]:
        """Verify every sampled request's drafts (none: a plain sample); one row each.

        ``logits`` holds ``1 + d`` rows per request of ``reqs``, in order. If the
        batched call raises, each request is verified alone (from the
        generator state it had) to find whose failure it is; ``fail`` ends it.
        """
        drafts = [scheduler_output.scheduled_spec_decode_tokens.get(r.request_id, [])
                  for r in reqs]
        seeded = {r.request_id: runner.seeded_generators[r.request_id].get_state()
                  for r in reqs if r.request_id in runner.seeded_generators}
        try:
            tokens, lp = self._verify(runner, logits, reqs, drafts)
        except Exception:  # noqa: BLE001 -- find whose it is, below
            tokens, lp, ok = [], [], []
            start = 0
            for req, d in zip(reqs, drafts):
                rows = logits[start : start + len(d) + 1]
                start += len(d) + 1
                if req.request_id in seeded:
                    runner.seeded_generators[req.request_id].set_state(seeded[req.request_id])
                try:
                    t, p = self._verify(runner, rows, [req], [d])
                except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                    fail(req, e)
                    continue
                tokens += t
                lp += p
                ok.append((req, d))
            reqs, drafts = [r for r, _ in ok], [d for _, d in ok]
        self.draft_probs = {}
        return ([(r, t, p) for r, t, p in zip(reqs, tokens, lp)],
                self._count(reqs, drafts, tokens, step))

    def _verify(self, runner, logits: torch.Tensor, reqs: list[Request],
                drafts: list[list[int]]) -> tuple[list[list[int]], list]:
        """``rejection_sample`` on one batch: emitted tokens and logprob rows per request."""
        metadata = SamplingMetadata.from_requests(
            reqs, self.vocab_size, runner.device, runner.generator, runner.seeded_generators)
        spec = SpecDecodeMetadata.make(drafts, self.vocab_size, logits.device)
        out = self.rejection_sampler.rejection_sample(
            logits, spec, self._draft_probs(reqs, drafts), metadata)
        tokens = out.parse_output()
        return tokens, self._logprobs(logits, drafts, tokens, metadata)

    def _draft_probs(self, reqs: list[Request], drafts: list[list[int]]) -> torch.Tensor | None:
        """The scheduled drafts' ``q`` rows, stacked; None for one-hot (n-gram) drafts."""
        probs = [self.draft_probs[r.request_id][: len(d)]
                 for r, d in zip(reqs, drafts) if d and r.request_id in self.draft_probs]
        if not probs:
            return None
        if len(probs) != sum(1 for d in drafts if d):
            raise ValueError("draft_probs are missing for some requests with drafts")
        return torch.cat(probs).to(torch.float32)

    @staticmethod
    def _logprobs(logits: torch.Tensor, drafts: list[list[int]], tokens: list[list[int]],
                  metadata: SamplingMetadata) -> list:
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
        lp = gather_logprobs(raw, torch.tensor(ids, device=raw.device),
                             metadata.max_num_logprobs)
        flat = list(zip(lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                        lp.selected_token_ranks.tolist()))
        out, at = [], 0
        for t in tokens:
            out.append(flat[at : at + len(t)])
            at += len(t)
        return out

    def _count(self, reqs: Sequence[Request], drafts: list[list[int]],
               tokens: list[list[int]], step: int) -> SpecStats:
        """This step's :class:`SpecStats`; feeds each request's back-off record."""
        k = self.config.num_speculative_tokens
        per_pos = [0] * k
        num_drafts = num_draft_tokens = num_accepted = 0
        for req, d, t in zip(reqs, drafts, tokens):
            if not d:
                continue
            accepted = len(t) - 1
            num_drafts += 1
            num_draft_tokens += len(d)
            num_accepted += accepted
            for j in range(accepted):
                per_pos[j] += 1
            self.backoff.record(req.request_id, accepted, len(d), step)
        return SpecStats(num_drafts, num_draft_tokens, num_accepted, tuple(per_pos))

    # -- proposing --------------------------------------------------------------------

    def propose(self, running: Sequence[Request], step: int) -> None:
        """Set ``spec_token_ids`` of every running request for the next step.

        Only a request whose every token but the last sampled one is computed
        gets drafts (not one in prefill or recomputing after a preemption),
        none while it is backed off, none at all in a step with at least
        ``disable_by_batch_size`` running requests.
        """
        limit = self.config.disable_by_batch_size
        batch_off = limit is not None and len(running) >= limit
        requests, caps = [], []
        for r in running:
            r.spec_token_ids = []
            if batch_off or r.status != RequestStatus.RUNNING \
                    or r.num_computed_tokens != r.num_tokens - 1 \
                    or not self.backoff.may_propose(r.request_id, step):
                continue
            cap = self.max_num_drafts(r)
            if cap > 0:
                requests.append(r)
                caps.append(cap)
        if not requests:
            return
        drafts, probs = self.proposer.propose(requests, caps)
        at = 0
        for r, d, cap in zip(requests, drafts, caps):
            d = list(d)
            if len(d) > cap:
                raise ValueError(f"the proposer gave request {r.request_id!r} {len(d)} drafts; "
                                 f"at most {cap} were allowed")
            r.spec_token_ids = d
            if probs is not None and d:
                self.draft_probs[r.request_id] = probs[at : at + len(d)]
            at += len(d)

    def max_num_drafts(self, request: Request) -> int:
        """``k``, capped so that no draft lies past what plain decoding could emit.

        Drafts stay below ``max_model_len`` and leave room for the extra token
        within ``max_tokens``; below ``min_tokens`` a request gets at most
        ``min_tokens - num_output_tokens - 1`` drafts, so that every position
        it verifies is still below ``min_tokens`` (the stop tokens stay masked
        at all of them, as the rejection sampler masks per request).
        """
        n_out = request.num_output_tokens
        cap = min(self.config.num_speculative_tokens,
                  self.max_model_len - request.num_tokens,
                  request.max_tokens - n_out - 1)
        min_tokens = request.sampling_params.min_tokens
        if n_out < min_tokens:
            cap = min(cap, min_tokens - n_out - 1)
        return max(cap, 0)

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request."""
        self.backoff.forget(request_id)
        self.draft_probs.pop(request_id, None)
