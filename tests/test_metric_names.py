"""``/metrics`` speaks vLLM's names, so vLLM's dashboards and autoscalers read minivllm.

Oracle: the table below, written from vLLM v0.11's ``vllm/v1/metrics/loggers.py``
(``PrometheusStatLogger``): each metric family's name, type, and label names. Every
family minivllm exports must be one of vLLM's with vLLM's type and labels (a renamed or
relabelled metric fails), and the metrics minivllm documents must all be exported.

Run: ``pytest -q tests/test_metric_names.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.engine.async_llm import IterationStats  # noqa: E402
from minivllm.entrypoints.openai.metrics import PrometheusStatLogger  # noqa: E402
from minivllm.outputs import StepStats  # noqa: E402

BASE = ("model_name", "engine")
#: vLLM v1 (v0.11): family name (without a counter's ``_total``) -> (type, label names).
VLLM = {
    "vllm:num_requests_running": ("gauge", BASE),
    "vllm:num_requests_waiting": ("gauge", BASE),
    "vllm:kv_cache_usage_perc": ("gauge", BASE),
    "vllm:num_preemptions": ("counter", BASE),
    "vllm:prefix_cache_queries": ("counter", BASE),
    "vllm:prefix_cache_hits": ("counter", BASE),
    "vllm:prompt_tokens": ("counter", BASE),
    "vllm:generation_tokens": ("counter", BASE),
    "vllm:request_success": ("counter", (*BASE, "finished_reason")),
    "vllm:time_to_first_token_seconds": ("histogram", BASE),
    "vllm:inter_token_latency_seconds": ("histogram", BASE),
    "vllm:e2e_request_latency_seconds": ("histogram", BASE),
    "vllm:iteration_tokens_total": ("histogram", BASE),
    "vllm:spec_decode_num_drafts": ("counter", BASE),
    "vllm:spec_decode_num_draft_tokens": ("counter", BASE),
    "vllm:spec_decode_num_accepted_tokens": ("counter", BASE),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", (*BASE, "position")),
}


def _families():
    logger = PrometheusStatLogger("m")
    stats = StepStats(step=0, num_scheduled_tokens={"a": 4}, decode_req_ids=frozenset({"a"}),
                      preempted_req_ids=("b",), finished_req_ids=(), num_running=1,
                      num_waiting=2, num_blocks=8, num_free_blocks=6, num_drafts=1,
                      num_draft_tokens=2, num_accepted_tokens=1,
                      num_accepted_tokens_per_pos=(1, 0))
    it = IterationStats(now=0.0)
    it.time_to_first_tokens.append(0.1)
    it.inter_token_latencies.append(0.02)
    it.finished.append(("stop", 0.5))
    logger(stats, it)
    return list(text_string_to_metric_families(logger.render().decode()))


def test_every_exported_metric_has_vllms_name_type_and_labels():
    families = _families()
    seen = set()
    for fam in families:
        if fam.name.endswith("_created"):  # prometheus_client's creation timestamps
            continue
        assert fam.name in VLLM, f"{fam.name} is not one of vLLM's metric names"
        kind, labels = VLLM[fam.name]
        assert fam.type == kind, (fam.name, fam.type, kind)
        for sample in fam.samples:
            names = tuple(k for k in sample.labels if k not in ("le",))
            assert sorted(names) == sorted(labels), (sample.name, sample.labels)
            assert sample.labels["model_name"] == "m" and sample.labels["engine"] == "0"
        seen.add(fam.name)
    assert seen == set(VLLM), set(VLLM) - seen


def test_the_values_land_in_vllms_series():
    """The step's numbers are read back under vLLM's sample names (a counter's ``_total``)."""
    values = {(s.name, s.labels.get("finished_reason"), s.labels.get("position")): s.value
              for fam in _families() for s in fam.samples}
    assert values[("vllm:num_requests_waiting", None, None)] == 2
    assert values[("vllm:kv_cache_usage_perc", None, None)] == pytest.approx(2 / 8)
    assert values[("vllm:num_preemptions_total", None, None)] == 1
    assert values[("vllm:request_success_total", "stop", None)] == 1
    assert values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", None, "0")] == 1
    assert values[("vllm:time_to_first_token_seconds_count", None, None)] == 1
