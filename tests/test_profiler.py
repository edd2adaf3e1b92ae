"""``minivllm.Profiler`` on a tiny model: the trace stays bounded, the tables add up.

The trace must hold the named ranges of the requested window of engine steps
and nothing else by default (no ATen operator events), and the op table must
name every op category with a positive time that fits inside forward + sample.
"""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.model.llama import op_range
from minivllm.profiler import OPS, STAGES

NUM_LAYERS = 2  # the tiny models in conftest


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), max_model_len=128, dtype="float32", device="cpu")


def _generate(llm: LLM, num_prompts: int = 3, max_tokens: int = 12) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 3 * i))} for i in range(num_prompts)]
    llm.generate(prompts, params, use_tqdm=False)


def _trace(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_trace_keeps_only_ranges_of_the_step_window(llm, tmp_path, capsys):
    path = tmp_path / "trace.json"
    with minivllm.Profiler(str(path), trace_steps=(2, 3)) as prof:
        _generate(llm)  # 12 decode steps after one prefill step: more than the window
    events = [e for e in _trace(path) if e.get("ph") == "X"]
    names = [e["name"] for e in events]
    assert names.count("schedule") == 3, "exactly the three steps of the window"
    assert not [n for n in names if n.startswith("aten::")], "op-level events are off"
    # Per step: the stages ("forward" twice: sending the step, and waiting for its
    # logits, which a pipeline does steps apart); per layer its range and 10 op ranges
    # (2 norms, 4 linears, rope, cache write, attention, activation); the final norm,
    # embedding and lm_head. Anything more is an unbounded source of events.
    per_step = len(STAGES) + 1 + NUM_LAYERS * (1 + 10) + 3
    assert names.count("forward") == 2 * 3
    assert len(events) <= 3 * per_step
    for stage in (*STAGES, "layer.0", "op.attention", "op.linear"):
        assert stage in names
    assert prof.num_trace_events == len(_trace(path))
    assert "op (forward + sample)" in capsys.readouterr().out


def test_record_ops_and_all_steps_are_opt_in(llm, tmp_path):
    small, big = tmp_path / "small.json", tmp_path / "big.json"
    with minivllm.Profiler(str(small), print_summary=False):
        _generate(llm, num_prompts=1, max_tokens=3)
    with minivllm.Profiler(str(big), print_summary=False, record_ops=True, trace_steps=None):
        _generate(llm, num_prompts=1, max_tokens=3)
    big_names = [e.get("name", "") for e in _trace(big)]
    assert any(n.startswith("aten::") for n in big_names)
    assert len(_trace(big)) > 3 * len(_trace(small))


def test_op_table_has_every_category_with_plausible_shares(llm, tmp_path, capsys):
    with minivllm.Profiler(str(tmp_path / "t.json")) as prof:
        _generate(llm, num_prompts=4, max_tokens=8)
    table = capsys.readouterr().out
    assert set(prof.op_times) == set(OPS)
    for op, secs in prof.op_times.items():
        assert secs > 0, f"no time recorded for {op}"
        assert f"\n{op} " in table
    total = prof.stage_times["forward"] + prof.stage_times["sample"]
    ops = sum(prof.op_times.values())
    # The op ranges sit inside forward and sample, and cover most of them: the model
    # does little besides calling its kernels.
    assert ops <= total * 1.001
    assert ops >= 0.3 * total
    assert 0 < prof.stage_times["layers (in forward)"] <= prof.stage_times["forward"]


def test_model_ranges_exist_only_while_profiling():
    assert isinstance(op_range("op.x"), nullcontext)
    with torch.profiler.profile() as prof:
        with op_range("op.x"):
            pass
    assert "op.x" in {e.key for e in prof.key_averages()}


def test_bad_trace_steps():
    with pytest.raises(ValueError, match="trace_steps"):
        minivllm.Profiler(trace_steps=(0, 0))
    with pytest.raises(ValueError, match="trace_steps"):
        minivllm.Profiler(trace_steps=(-1, 4))
