"""Benchmarks that survive a noisy machine: alternated runs, medians, spreads, limits.

``minivllm/bench/_alternate.py`` and the llama.cpp comparison built on it
(``minivllm/bench/_vs_llamacpp.py``), run end to end on a tiny model against
fake llama.cpp tools whose speed changes from run to run. No figure is timed.
Run: ``pytest -q tests/test_bench_alternate.py --backend=ref``.
"""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from minivllm.bench import _alternate as alt
from minivllm.bench import _vs_llamacpp


def test_sides_alternate_and_rotate_who_goes_first():
    calls = []
    sides = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "ABC"}
    got = alt.alternate(sides, 3)
    assert calls == list("ABC" "BCA" "CAB")
    assert got == {"A": [1, 6, 8], "B": [2, 4, 9], "C": [3, 5, 7]}
    with pytest.raises(ValueError, match="repeats"):
        alt.alternate(sides, 0)


@pytest.mark.parametrize("runs,median,spread,noisy", [
    ((10.0,), 10.0, 0.0, False),
    ((10.0, 10.0, 10.0), 10.0, 0.0, False),
    ((9.0, 10.0, 10.5), 10.0, 0.15, False),  # exactly the threshold: not noisy
    ((9.0, 10.0, 10.6), 10.0, 0.16, True),
    ((30.0, 10.0, 20.0), 20.0, 1.0, True),  # one run 3x another: a shared machine
])
def test_a_figure_is_its_median_and_spread(runs, median, spread, noisy):
    f = alt.Figure(runs)
    assert f.median == median and f.spread == pytest.approx(spread) and f.noisy is noisy
    assert str(f).endswith("noisy") is noisy
    assert f.as_dict()["runs"] == list(runs)


def test_figures_follow_nested_numbers_only():
    runs = [{"a": 1, "b": {"c": 2.0, 1: {"d": 5}}, "s": "x", "flag": True, "gone": 1.0},
            {"a": 3, "b": {"c": 4.0, 1: {"d": 7}}, "s": "y", "flag": False}]
    got = alt.figures(runs)
    assert set(got) == {"a", "b"} and got["a"].runs == (1.0, 3.0)
    assert got["b"]["c"].median == 3.0 and got["b"][1]["d"].runs == (5.0, 7.0)
    assert alt.as_json(got)["b"]["1"]["d"]["median"] == 6.0


def test_the_gemm_floor_grows_with_the_batch_and_counts_every_layer():
    cfg = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                                vocab_size=256, model_type="llama")
    deeper = types.SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 200})
    assert _vs_llamacpp.gemm_floor_tok_s(cfg, 64, torch.float32) > \
        _vs_llamacpp.gemm_floor_tok_s(deeper, 64, torch.float32)


def _fake_tools(bin_dir, counter):
    """llama-batched-bench / llama-bench whose speed grows by 50 tok/s at every call of
    either (one counter): a machine whose load changes from run to run."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    head = (f"#!/bin/sh\nn=$(cat {counter} 2>/dev/null || echo 0)\n"
            f"echo $((n + 1)) > {counter}\nS=$((100 + 50 * n))\n")
    batched = "".join(
        f'echo "{{\\"pl\\": {b}, \\"speed\\": $S, \\"speed_tg\\": $S, '
        f'\\"speed_pp\\": 900, \\"t_pp\\": 1, \\"t_tg\\": 1, \\"t\\": 2}}"\n'
        for b in (1, 2))
    bench = 'echo "{\\"n_prompt\\": 32, \\"n_gen\\": 0, \\"avg_ts\\": $S}"\n'
    for name, body in {"llama-batched-bench": batched, "llama-bench": bench}.items():
        tool = bin_dir / name
        tool.write_text(head + body)
        tool.chmod(0o755)


def test_the_comparison_alternates_runs_and_reports_medians_spreads_and_limits(
        tiny_model_dir, tmp_path, capsys, backend_spec):
    from minivllm.bench import throughput

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "tiny.Q4_1.gguf").write_bytes(b"\0" * 4096)  # its size: the bytes a step reads
    _fake_tools(tmp_path / "bin", tmp_path / "calls")
    out = tmp_path / "r" / "t.json"
    code = throughput.main([
        "--model", str(model), "--backend", backend_spec, "--device", "cpu",
        "--compare", "llamacpp", "--llamacpp-dir", str(tmp_path), "--formats", "Q4_1",
        "--dtypes", "float32", "--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "4",
        "--prefill-len", "32", "--repeats", "3", "--threads", "1", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    data = json.loads((out.parent / "bench_vs_llamacpp.json").read_text())
    figs = data["figures"]
    assert set(figs) == {"limits", "minivllm float32", "llama.cpp Q4_1"}
    theirs = figs["llama.cpp Q4_1"]
    # Three runs each: batched-bench is call 0, 2 and 4 of the fake tools (llama-bench
    # the others), so 100, 200, 300 tok/s: median 200, spread 1.0 -> noisy.
    assert theirs["1"]["decode_tok_s"]["runs"] == [100.0, 200.0, 300.0]
    assert theirs["1"]["decode_tok_s"]["noisy"] is True
    assert theirs["prefill_tok_s"]["runs"] == [150.0, 250.0, 350.0]
    ours = figs["minivllm float32"]
    assert len(ours["2"]["decode_tok_s"]["runs"]) == 3 and ours["2"]["decode_tok_s"]["median"] > 0
    assert len(figs["limits"]["read_gb_s"]["runs"]) == 3
    assert figs["limits"]["gemm_floor_torch.float32"]["median"] > 0
    assert data["weight_bytes"]["llama.cpp Q4_1"] == 4096
    assert "flags" in data["machine"] or "cpu" in data["machine"]
    assert "median±spread" in printed and "noisy" in printed and "GEMM floor" in printed
    assert "alternated runs" in printed


def test_ratios_are_of_medians_and_name_noise():
    f = alt.Figure
    result = {
        "limits": {"read_gb_s": f((10.0,)), "gemm_floor_torch.float32": f((1000.0,))},
        "minivllm float32": {1: {"decode_tok_s": f((20.0, 22.0, 21.0)),
                                 "total_tok_s": f((40.0, 40.0, 40.0))},
                             64: {"decode_tok_s": f((500.0, 500.0, 500.0)),
                                  "total_tok_s": f((900.0, 900.0, 900.0))}},
        "llama.cpp F32": {1: {"decode_tok_s": f((10.0, 30.0, 20.0)),
                              "total_tok_s": f((20.0, 20.0, 20.0))},
                          64: {"decode_tok_s": f((250.0, 250.0, 250.0)),
                               "total_tok_s": f((450.0, 450.0, 450.0))}},
    }
    args = types.SimpleNamespace(model="m", prompt_len=8, gen_len=4, threads=2, repeats=3,
                                 prefill_len=0)
    lines = _vs_llamacpp.report(result, {"minivllm float32": 10**9, "llama.cpp F32": 10**9},
                                {"minivllm float32": torch.float32,
                                 "llama.cpp F32": torch.float32}, [1, 64], args, (0.0,))
    ratio = next(line for line in lines if "float32 vs F32" in line)
    assert "B=1 decode 1.05x (noisy)" in ratio  # 21 / 20, llama.cpp's side is noisy
    assert "B=64 decode 2.00x" in ratio and "B=64 decode 2.00x (noisy)" not in ratio
    row = next(line for line in lines if line.startswith("minivllm float32"))
    assert "210%" in row  # B=1: 21 tok/s of a 10 tok/s roofline (10 GB/s over 1 GB)
    assert "50%" in row  # B=64: 500 of a 1000 tok/s GEMM floor
