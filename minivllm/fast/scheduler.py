"""The continuous-batching scheduler with cheaper bookkeeping (twin of the ref).

The scheduling *policy* (budget, order, chunked prefill, preemption, prefix
cache, rejection) is exactly :mod:`minivllm.ref.scheduler`'s; read that file
for it. This twin subclasses the ref and keeps its :meth:`schedule`
unchanged on purpose: the decision loop is a handful of integer comparisons
per request, and sharing the code is the surest way to make the same
decisions. What it replaces is the bookkeeping around the loop, where the
ref does O(n) work per request:

- It uses :mod:`minivllm.fast.kv_cache_manager`: per-request block lists kept
  in place (no copies from the block tables every step), a fast path that
  skips the allocator for decodes whose last block still has room, and block
  hashes kept across preemptions.
- :meth:`update_from_output` removes finished requests from ``running`` in
  one pass at the end, instead of ``list.remove`` per finished request
  (O(running) each, so O(running x finished) per step).

Together with the fast block allocator (O(1) free queue) and block tables
(preallocated tensor, vectorised slot mapping) that the swap layer hands it,
this is what ``python -m minivllm.bench host`` measures.
"""

from __future__ import annotations

import torch

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.fast.kv_cache_manager import KVCacheManager
from minivllm.metadata import SchedulerOutput
from minivllm.ref import scheduler as _ref
from minivllm.request import Request, RequestStatus, check_stop

__all__ = ["Scheduler"]


class Scheduler(_ref.Scheduler):
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        scheduler_config: budget, ``max_num_seqs``, ``max_model_len``, chunking.
        cache_config: ``num_blocks`` (the pool), ``block_size``, prefix caching.
        device: where ``block_tables`` builds its tensors for the model runner.

    The block allocator and the block tables are whichever implementations
    the swap layer selects when the scheduler is built.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(scheduler_config, cache_config, device)
        self.kv_cache_manager = KVCacheManager(self.block_allocator, self.block_tables)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Record a finished forward pass; return the requests that finished now.

        Args:
            scheduler_output: what :meth:`schedule` returned for this step.
            sampled_token_ids: request id -> the token sampled for it (only
                requests whose every token is computed after this step).
        """
        finished = []
        requests = self.requests
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        max_model_len = self.max_model_len
        for request in scheduler_output.scheduled_requests:
            req_id = request.request_id
            if requests.get(req_id) is not request:
                continue  # aborted since schedule()
            request.num_computed_tokens += num_scheduled_tokens[req_id]
            token_id = sampled_token_ids.get(req_id)
            if token_id is None or request.num_computed_tokens < request.num_tokens:
                continue
            request.append_output_token_ids(token_id)
            if check_stop(request, max_model_len):
                self._free_request(request)
                finished.append(request)
        if finished:
            # One pass over `running` for all of them; order is preserved.
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return finished
