"""``minivllm bench pp``: its bubble arithmetic, and a bounded run on a tiny model.

The bubble is checked on hand-built timelines of an ideal pipeline (equal
stages, free sends), where the textbook ``(p - 1) / (m + p - 1)`` is exact:
an independent oracle for :func:`measured_bubble`. The run itself is a smoke
test (tiny model, seconds); no timing is asserted, only what must hold
whatever the machine: every table row, bubbles in [0, 1), and a pipeline
stage holding fewer weight bytes than the whole model.
"""

from __future__ import annotations

import json
import re

import pytest

from minivllm.bench import pp as bench_pp
from minivllm.pp_stages import StageTiming


def ideal_timeline(p: int, m: int, tp: int = 1, t: float = 0.25) -> list[StageTiming]:
    """GPipe's schedule: stage s runs micro-batch i in [(i + s) t, (i + s + 1) t]."""
    return [StageTiming(i, s * tp + r, s, r, (i + s) * t, (i + s + 1) * t)
            for i in range(m) for s in range(p) for r in range(tp)]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (3, 4), (4, 8)])
def test_measured_bubble_of_an_ideal_pipeline_is_the_textbook(p: int, m: int) -> None:
    want = (p - 1) / (m + p - 1)
    assert bench_pp.textbook_bubble(p, m) == pytest.approx(want)
    assert bench_pp.measured_bubble(ideal_timeline(p, m), p) == pytest.approx(want)
    # A stage's tensor-parallel ranks count once, however many there are.
    assert bench_pp.measured_bubble(ideal_timeline(p, m, tp=2), p) == pytest.approx(want)


def test_a_slow_stage_and_a_gap_show_in_the_bubble() -> None:
    # Stage 1 takes twice as long and starts 0.5 late: busy 1 + 2 over a span of 3.5.
    records = [StageTiming(0, 0, 0, 0, 0.0, 1.0), StageTiming(0, 1, 1, 0, 1.5, 3.5)]
    assert bench_pp.measured_bubble(records, 2) == pytest.approx(1 - 3 / (2 * 3.5))
    with pytest.raises(ValueError, match="no stage timings"):
        bench_pp.measured_bubble([], 2)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit, match="--micro-batches must be ints >= 1"):
        bench_pp.main(["--micro-batches", "2,0"])
    with pytest.raises(SystemExit, match="--output-len must be >= 1, got 0"):
        bench_pp.main(["--output-len", "0"])


@pytest.mark.slow
def test_bench_pp_runs_on_a_tiny_model(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "bench_pp.json"
    assert bench_pp.main(["--model", str(tiny_model_dir("llama")), "--num-prompts", "3",
                          "--input-len", "6", "--output-len", "3", "--micro-batches", "1,3",
                          "--micro-batch-len", "5", "--kv-cache-memory", str(8 << 20),
                          "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("pp=1", "pp=2", "tp=2"):
        assert re.search(rf"^{re.escape(name)} ", text, re.M), text
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["throughput"]] == ["pp=1", "pp=2", "tp=2"]
    assert all(r["output_tokens"] == 3 * 3 for r in result["throughput"])
    assert [b["m"] for b in result["bubble"]] == [1, 3]
    assert all(0 <= b["measured"] < 1 for b in result["bubble"])
    one, two = (r["memory"] for r in result["throughput"][:2])
    assert len(one) == 1 and len(two) == 2
    assert all(rank["weights"] < one[0]["weights"] for rank in two)  # each stage: its layers
