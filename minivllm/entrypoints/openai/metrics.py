"""``/metrics``: the engine's state in Prometheus format, with vLLM's metric names.

The names, types and label names are vLLM v1's (``vllm/v1/metrics/loggers.py``:
the ``vllm:`` prefix, ``model_name`` and ``engine`` on every series, ``finished_reason``
and ``position`` where vLLM has them), so vLLM's Grafana dashboard and an autoscaler that
reads vLLM's ``/metrics`` work unchanged. minivllm has one engine core: ``engine="0"``.
Every metric lives in a per-server ``CollectorRegistry`` (never the global
one), so two servers in one process (tests, the tutorial) do not collide.
:class:`PrometheusStatLogger` is an :class:`~minivllm.engine.async_llm.AsyncLLM`
stat logger: it is called after every engine step with that step's
:class:`~minivllm.outputs.StepStats` and request timings.

==================================================  ==========  ========================================
name                                                type        what
==================================================  ==========  ========================================
vllm:num_requests_running                           gauge       requests holding KV blocks
vllm:num_requests_waiting                           gauge       requests queued for a slot
vllm:kv_cache_usage_perc                            gauge       fraction of KV blocks in use (0-1)
vllm:num_preemptions_total                          counter     requests preempted (recomputed)
vllm:prefix_cache_queries_total                     counter     prompt tokens looked up
vllm:prefix_cache_hits_total                        counter     of those, found cached
vllm:prompt_tokens_total                            counter     prompt tokens of admitted requests
vllm:generation_tokens_total                        counter     tokens generated
vllm:request_success_total                          counter     finished requests, by finished_reason
vllm:time_to_first_token_seconds                    histogram   arrival to first token
vllm:inter_token_latency_seconds                    histogram   between consecutive tokens
vllm:e2e_request_latency_seconds                    histogram   arrival to finish
vllm:iteration_tokens_total                         histogram   tokens computed per engine step
vllm:spec_decode_num_drafts_total                   counter     requests that verified drafts (per step)
vllm:spec_decode_num_draft_tokens_total             counter     draft tokens verified
vllm:spec_decode_num_accepted_tokens_total          counter     draft tokens accepted
vllm:spec_decode_num_accepted_tokens_per_pos_total  counter     accepted, by ``position``
==================================================  ==========  ========================================

The ``spec_decode`` counters (vLLM's names, speculative decoding only) give
the acceptance rate ``accepted / draft_tokens`` and the mean acceptance length
``1 + accepted / drafts``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.engine.async_llm import IterationStats
from minivllm.outputs import StepStats

# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
#: vLLM's metric prefix and label names (vllm/v1/metrics/loggers.py).
PREFIX = "vllm:"
LABEL_NAMES = ("model_name", "engine")
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class PrometheusStatLogger:
    """Owns the server's metrics; call it with each step's stats to update them.

    Args:
        model_name: the ``model_name`` label on every metric (as vLLM).
        engine: the ``engine`` label (vLLM's engine-core index; minivllm has one).
    """

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = list(LABEL_NAMES)
        values = (model_name, engine)
        self._label_values = values
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}{name}", doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{PREFIX}{name}", doc, labels, buckets=buckets,
                             registry=r).labels(*values)

        self.num_running = gauge("num_requests_running", "Requests holding KV blocks.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "KV-cache usage: 1 means every block is held by a request.")
        self.preemptions = counter("num_preemptions", "Requests preempted and recomputed.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(f"{PREFIX}request_success", "Finished requests.",
                                [*labels, "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the last token.", _E2E_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Requests that verified draft tokens, summed over steps.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self._spec_per_pos = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, per draft position.",
                                     [*labels, "position"], registry=r)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens computed per engine step.", _TOKEN_BUCKETS)

    def __call__(self, stats: StepStats, it: IterationStats) -> None:
        """Record one engine step."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(len(stats.preempted_req_ids))
        self.prefix_queries.inc(stats.num_prefix_cache_queries)
        self.prefix_hits.inc(stats.num_prefix_cache_hits)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if stats.num_batched_tokens:
            self.iteration_tokens.observe(stats.num_batched_tokens)
        if stats.num_drafts:
            self.spec_drafts.inc(stats.num_drafts)
            self.spec_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_accepted.inc(stats.num_accepted_tokens)
            for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
                self._spec_per_pos.labels(*self._label_values, str(pos)).inc(n)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for reason, e2e in it.finished:
            self._success.labels(*self._label_values, reason).inc()
            self.e2e.observe(e2e)

    def render(self) -> bytes:
        """The text exposition format that ``GET /metrics`` returns."""
        return generate_latest(self.registry)
