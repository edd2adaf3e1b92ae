"""``minivllm bench serve --soak``: the request mix, the per-window report, the targets,
and a short real soak of a tiny model's server (a benchmark's plumbing, not a timed test).

Run: ``pytest -q tests/test_bench_soak.py --backend=ref``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from minivllm.bench import _soak as soak
from minivllm.bench._soak import SoakResult


def test_the_mix_is_seeded_and_has_its_proportions():
    kw = dict(vocab=100, input_len=(3, 9), output_len=(2, 5), adapters=["a", "b"], seed=7)
    mix = soak.make_mix(4000, 20.0, **kw)
    assert mix == soak.make_mix(4000, 20.0, **kw)
    assert mix != soak.make_mix(4000, 20.0, **{**kw, "seed": 8})
    gaps = np.diff([m.at for m in mix])
    assert mix[0].at == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 1 / 20) < 0.005  # Poisson at 20 req/s
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential gaps: CV 1
    share = {name: np.mean([bool(f(m)) for m in mix]) for name, f in {
        "n2": lambda m: m.n == 2, "regex": lambda m: m.regex,
        "lora": lambda m: m.adapter, "hang": lambda m: m.hang_up_after}.items()}
    assert abs(share["n2"] - 0.2) < 0.03
    assert all(abs(share[k] - 0.1) < 0.025 for k in ("regex", "lora", "hang"))
    assert {m.adapter for m in mix} == {None, "a", "b"}
    assert all(3 <= len(m.prompt) <= 9 and 2 <= m.max_tokens <= 5 for m in mix)
    assert all(0 <= t < 100 for m in mix for t in m.prompt)
    burst = soak.make_mix(50, math.inf, **{**kw, "adapters": []}, hang_ups=False)
    assert all(m.at == 0 and m.adapter is None and m.hang_up_after is None for m in burst)


def test_windows_group_requests_by_arrival():
    results = [SoakResult(at=0.5, status=200, ttft=0.2, itl=[0.01, 0.03]),
               SoakResult(at=1.5, status=200, ttft=4.0, itl=[0.05]),
               SoakResult(at=1.7, status=503, error="full"),
               SoakResult(at=2.2, status=200, ttft=0.1)]
    samples = [(0.4, 100 * 2**20, 1), (1.2, 110 * 2**20, 3), (1.9, 120 * 2**20, 2)]
    rows = soak.windows(results, samples, window_s=1.0, duration=2.5)
    assert [r["requests"] for r in rows] == [1, 2, 1]
    assert rows[0]["ttft_p50_s"] == rows[0]["ttft_p99_s"] == 0.2
    assert rows[1]["ttft_p99_s"] == 4.0 and rows[1]["errors"] == 1  # the 503 has no TTFT
    assert rows[0]["itl_p50_s"] == pytest.approx(0.02)
    assert [r["rss_mb"] for r in rows[:2]] == [100, 120]  # the window's last sample
    assert rows[1]["in_flight"] == 3 and math.isnan(rows[2]["rss_mb"])


def _row(ttft_p99: float, rss: float) -> dict:
    return {"ttft_p99_s": ttft_p99, "rss_mb": rss}


@pytest.mark.parametrize("case,missed", [
    ("good", None),
    ("slow window", "p99 TTFT"),
    ("5xx", "no 5xx"),
    ("error event", "no 5xx"),
    ("leak", "leaked"),
    ("rss grows", "RSS"),
    ("other answer", "greedy"),
])
def test_each_target_can_be_missed(case, missed):
    rows = [_row(0.5, 50.0), _row(1.0, 100.0), _row(4.9, 104.0), _row(math.nan, 103.0)]
    results = [SoakResult(at=0, status=200, ttft=0.1)]
    leaked, same = 0, True
    if case == "slow window":
        rows[2]["ttft_p99_s"] = 5.1
    elif case == "5xx":
        results.append(SoakResult(at=1, status=500))
    elif case == "error event":
        results.append(SoakResult(at=1, status=200, error="the engine failed"))
    elif case == "leak":
        leaked = 1
    elif case == "rss grows":
        rows[3]["rss_mb"] = 106.0  # 6% over the smallest after warm-up
    elif case == "other answer":
        same = False
    got = soak.verdict(rows, results, leaked, same)
    assert [t for t, met in got.items() if not met] == (
        [] if missed is None else [t for t in got if missed in t])


def test_a_short_soak_of_a_real_server(tiny_model_dir, backend_spec, tmp_path):
    """Two seconds at 80% of capacity, with n=2, regex, an adapter and hang-ups in the
    mix: every answer arrives, nothing leaks, the greedy answer holds."""
    from minivllm import LLM
    from minivllm.bench._lora_e2e import write_random_adapter
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.entrypoints.openai.cli_args import load_lora_modules

    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", max_model_len=256,
              backend="auto" if backend_spec == "fast" else backend_spec, enable_lora=True,
              max_loras=1, max_lora_rank=16)
    engine = llm.llm_engine
    adapter = write_random_adapter(tmp_path / "soak-adapter", engine.executor.hf_config, 16, 0)
    modules = load_lora_modules(engine, [f"ad={adapter}"], "tiny")
    server = ServerThread.start(AsyncLLM(engine), "tiny", lora_modules=modules)
    try:
        report = soak.run_soak(engine, server.base_url, "tiny", engine.vocab_size, 2.0,
                               window_s=1.0, input_len=(3, 20), output_len=(2, 12),
                               adapters=["ad"], capacity_requests=12)
    finally:
        server.stop()
    assert report["capacity"] > 0 and report["num_requests"] >= 1
    assert report["num_5xx"] == 0 and report["num_errors"] == 0, report["errors"]
    assert report["leaked_blocks"] == 0
    assert report["greedy_before"] == report["greedy_after"]
    assert len(report["windows"]) >= 2
    assert set(report["targets"]) == set(soak.verdict(report["windows"], [], 0, True))


def test_python_m_minivllm_bench_lists_only_benchmarks():
    """Every name it offers has a ``main``; the helpers are private (``_name``)."""
    import importlib

    from minivllm.bench.__main__ import available

    names = available()
    assert "serve" in names and "latency" in names
    assert all(callable(getattr(importlib.import_module(f"minivllm.bench.{n}"), "main", None))
               for n in names), names
