"""``ModelRunner``: turn a :class:`SchedulerOutput` into a step's batch, and logits into tokens.

This is the "batch metadata" stage of the pipeline, on the engine's side (rank
0). For every scheduled request it takes the tokens the scheduler asked for,
lays them end to end in one flat batch (no padding), and records each token's
position, each request's query and context length, the rows whose logits are
sampled, and the block-table changes the scheduler made: a
:class:`~minivllm.metadata.StepInput`.

It builds no block table: that lives on every rank, in the
:class:`~minivllm.engine.worker.Worker`, which applies the changes and builds
the step's :class:`~minivllm.metadata.AttentionMetadata` itself (as vLLM v1's
workers do), so the executor sends each rank only what changed.
"""

from __future__ import annotations

import torch

from minivllm import backend
from minivllm.metadata import SchedulerOutput, StepInput
from minivllm.request import Request
from minivllm.sampling_metadata import SamplerOutput, SamplingMetadata


class ModelRunner:
    """Builds each step's :class:`~minivllm.metadata.StepInput` and samples from its logits.

    Args:
        vocab_size: the model's vocabulary size (for sampling metadata).
        device: where the logits (rank 0's model device) and the sampler live.
        seed: seed of the generator shared by requests without their own seed.
        components: the engine's :class:`~minivllm.backend.Components` (the
            sampler comes from it; None resolves the global spec once).
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0,
                 components: backend.Components | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = backend.as_components(components).sampler
        # Requests without a seed share one generator; seeded ones get their own
        # (created in add_request), advanced only when that request samples.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeded_generators: dict[str, torch.Generator] = {}

    def make_generator(self, request: Request) -> torch.Generator | None:
        """The request's own generator if it has a seed (built, not yet stored).

        The engine builds it before the scheduler sees the request, so that a
        seed torch refuses fails the request's add, not a later step.
        """
        seed = request.sampling_params.seed
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def add_request(self, request: Request, generator: torch.Generator | None = None) -> None:
        """Store the request's own generator (made by :meth:`make_generator` if not given)."""
        if generator is None:
            generator = self.make_generator(request)
        if generator is not None:
            self.seeded_generators[request.request_id] = generator

    def remove_request(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self.seeded_generators.pop(request_id, None)

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[StepInput, list[Request], dict[str, Exception]]:
        """Flatten the scheduled chunks into one batch.

        Returns the step input, the requests that sample a token this step
        (those whose every token will have been computed after this step: a
        prefill chunk that is not the last one produces no token; a request
        verifying ``d`` drafts has ``1 + d`` logits rows), and the
        requests whose inputs could not be built (request id -> the error).
        Those are left out of the batch; the engine aborts them alone.
        """
        reqs, starts, counts, chunks = [], [], [], []
        failed: dict[str, Exception] = {}
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for r in scheduler_output.scheduled_requests:
            s, n = r.num_computed_tokens, scheduler_output.num_scheduled_tokens[r.request_id]
            drafts = spec_tokens.get(r.request_id, [])
            try:
                # A decode with drafts: its last sampled token, then the drafts.
                chunk = self._request_tokens(r, s, n - len(drafts)) + drafts
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                failed[r.request_id] = e
                continue
            reqs.append(r)
            starts.append(s)
            counts.append(n)
            chunks.append(chunk)
        req_ids = tuple(r.request_id for r in reqs)

        token_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Request] = []
        for r, s, n, chunk in zip(reqs, starts, counts, chunks):
            token_ids.extend(chunk)
            positions.extend(range(s, s + n))
            num_drafts = len(spec_tokens.get(r.request_id, ()))
            if s + n - num_drafts == r.num_tokens:
                # Its last real token's logits predict the next token; each draft's
                # logits, the token after it (speculation: 1 + d rows, in order).
                end = len(token_ids)
                logits_indices.extend(range(end - 1 - num_drafts, end))
                sampling.append(r)
        new_block_ids = scheduler_output.new_block_ids
        step_input = StepInput(
            req_ids=req_ids,
            new_req_ids=frozenset(scheduler_output.new_req_ids),
            new_block_ids=tuple(tuple(new_block_ids.get(i, ())) for i in req_ids),
            removed_req_ids=tuple(scheduler_output.removed_req_ids),
            query_lens=tuple(counts),
            seq_lens=tuple(s + n for s, n in zip(starts, counts)),
            input_ids=torch.tensor(token_ids, dtype=torch.int64),  # (T,)
            positions=torch.tensor(positions, dtype=torch.int64),  # (T,)
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),  # (num_sampled,)
        )
        return step_input, sampling, failed

    @staticmethod
    def _request_tokens(request: Request, start: int, count: int) -> list[int]:
        """The ``count`` token ids of ``request`` from ``start`` that this step computes."""
        chunk = request.all_token_ids[start : start + count]
        if len(chunk) != count:
            raise ValueError(f"request {request.request_id!r}: {count} tokens scheduled from "
                             f"{start}, but it has {request.num_tokens}")
        return chunk

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row of ``logits`` (row i belongs to ``requests[i]``)."""
        metadata = SamplingMetadata.from_requests(
            requests, self.vocab_size, self.device, self.generator, self.seeded_generators
        )
        return self.sampler.sample(logits, metadata)
