"""``python -m minivllm.bench structured`` runs: its parts on a small tokenizer (no timing asserted)."""

from __future__ import annotations

from structured_utils import synthetic_tokenizer

from minivllm.bench import structured
from minivllm.fast import structured_output as fast_so
from minivllm.ref import structured_output as ref_so


def test_bench_parts_run_and_report_every_case():
    tok = synthetic_tokenizer()
    impls = {"ref": ref_so, "fast": fast_so}
    rows = structured.bench_masks(impls, tok, len(tok))
    assert {(r["twin"], r["case"]) for r in rows} == {
        (t, c) for t in impls for c, _, _ in structured.CASES}
    assert all(r["tokens"] > 1 and r["cold_mean_ms"] > 0 and r["compile_ms"] > 0 for r in rows)
    applied = structured.bench_apply(impls, 1000, batch_sizes=(3,), repeats=2)
    assert len(applied) == 2 and all(r["apply_ms"] > 0 for r in applied)


def test_bench_end_to_end_runs_on_a_tiny_model(tiny_model_dir):
    rows = structured.bench_end_to_end(("ref", "fast"), (1, 3), model=str(tiny_model_dir("llama")),
                                       max_tokens=12, repeats=1)
    assert [(r["twin"], r["batch"]) for r in rows] == [("ref", 1), ("ref", 3), ("fast", 1),
                                                       ("fast", 3)]
    assert all(r["tokens"] >= r["batch"] and r["constrained_ms"] > 0
               and r["unconstrained_ms"] > 0 and 0 < r["mask_share"] < 1 for r in rows)

