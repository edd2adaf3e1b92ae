"""The continuous-batching scheduler with cheaper bookkeeping (twin of the ref).

The scheduling *policy* (budget, order, chunked prefill, preemption, prefix
cache, rejection) is exactly :mod:`minivllm.ref.scheduler`'s; read that file
for it. This twin subclasses the ref and keeps its :meth:`schedule`
unchanged on purpose: the decision loop is a handful of integer comparisons
per request, and sharing the code is the surest way to make the same
decisions. It changes one thing:

- :meth:`update_from_output` removes finished requests from ``running`` in
  one pass at the end, instead of ``list.remove`` per finished request
  (O(running) each, so O(running x finished) per step).

The rest of the speed comes from the twins the swap layer hands it: the fast
block allocator (O(1) free queue) and the fast KV cache manager (a decode
fast path that skips the allocator). That is what
``python -m minivllm.bench host`` measures.
"""

from __future__ import annotations

from minivllm.metadata import SchedulerOutput
from minivllm.ref import scheduler as _ref
from minivllm.request import Request, RequestStatus, check_stop

__all__ = ["Scheduler"]


class Scheduler(_ref.Scheduler):
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        scheduler_config: budget, ``max_num_seqs``, ``max_model_len``, chunking.
        cache_config: ``num_blocks`` (the pool), ``block_size``, prefix caching.
        kv_cache_manager_cls: the ``KVCacheManager`` class to build on the
            block allocator; None takes the one the swap layer selects.
    """

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
