"""``ModelRunner``: turn a :class:`SchedulerOutput` into model inputs, and logits into tokens.

This is the "batch metadata" stage of the pipeline. For every scheduled
request it takes the tokens the scheduler asked for, lays them end to end in
one flat batch (no padding), and computes for each token its position and the
KV-cache slot it writes, plus the per-sequence block tables and lengths that
attention reads (:class:`~minivllm.metadata.AttentionMetadata`).

It runs on rank 0 only: with tensor parallelism the executor broadcasts the
finished :class:`~minivllm.metadata.ModelInput` to the other ranks.
"""

from __future__ import annotations

import torch

from minivllm import backend
from minivllm.metadata import AttentionMetadata, ModelInput, SchedulerOutput
from minivllm.request import Request
from minivllm.sampling_metadata import SamplerOutput, SamplingMetadata


class ModelRunner:
    """Builds each step's :class:`ModelInput` and samples from its logits.

    Args:
        vocab_size: the model's vocabulary size (for sampling metadata).
        device: where the batch tensors live (the model's device).
        seed: seed of the generator shared by requests without their own seed.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = backend.get("sampler")
        # Requests without a seed share one generator; seeded ones get their own
        # (created in add_request), advanced only when that request samples.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeded_generators: dict[str, torch.Generator] = {}

    def add_request(self, request: Request) -> None:
        """Create the request's own generator if it has a seed."""
        seed = request.sampling_params.seed
        if seed is not None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.seeded_generators[request.request_id] = g

    def remove_request(self, request_id: str) -> None:
        self.seeded_generators.pop(request_id, None)

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput, block_tables
    ) -> tuple[ModelInput, list[Request]]:
        """Flatten the scheduled chunks into one batch.

        Returns the model input and the requests that sample a token this step:
        those whose every token will have been computed after this step (a
        prefill chunk that is not the last one produces no token).
        """
        reqs = scheduler_output.scheduled_requests
        req_ids = [r.request_id for r in reqs]
        starts = [r.num_computed_tokens for r in reqs]
        counts = [scheduler_output.num_scheduled_tokens[i] for i in req_ids]

        token_ids: list[int] = []
        positions: list[int] = []
        for r, s, n in zip(reqs, starts, counts):
            token_ids.extend(r.all_token_ids[s : s + n])
            positions.extend(range(s, s + n))
        dev = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)  # (T,)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)  # (T,)
        attn_metadata = AttentionMetadata.build(
            query_lens=counts,
            seq_lens=[s + n for s, n in zip(starts, counts)],
            block_tables=block_tables.block_table_tensor(req_ids),
            slot_mapping=block_tables.slot_mapping(req_ids, starts, counts),
            device=dev,
        )
        cu_counts = attn_metadata.query_start_loc_host
        sampling = [i for i, (r, s, n) in enumerate(zip(reqs, starts, counts))
                    if s + n == r.num_tokens]
        # The last scheduled token of each sampling request: its logits predict the next.
        logits_indices = torch.tensor([cu_counts[i + 1] - 1 for i in sampling],
                                      dtype=torch.int64, device=dev)
        model_input = ModelInput(input_ids, positions_t, attn_metadata, logits_indices)
        return model_input, [reqs[i] for i in sampling]

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row of ``logits`` (row i belongs to ``requests[i]``)."""
        metadata = SamplingMetadata.from_requests(
            requests, self.vocab_size, self.device, self.generator, self.seeded_generators
        )
        return self.sampler.sample(logits, metadata)
