"""``minivllm bench latency``: its step timing and its host-overhead arithmetic."""

from __future__ import annotations

import pytest

from minivllm import LLM
from minivllm.bench import latency


def test_time_batch_counts_one_step_per_later_token(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu")
    prompts = latency.random_prompts(3, 20, llm.llm_engine.vocab_size)
    t = latency.time_batch(llm, prompts, 7)
    # The first step is the prefill of all three (and their first tokens): 6 decode steps follow.
    assert len(t.decode_steps_s) == 6
    assert 0 < t.ttft_s <= t.total_s
    assert t.total_s == pytest.approx(t.ttft_s + t.decode_s)
    # Host time per decode step, engine-timed: positive and below the step's wall time.
    assert len(t.host_steps_s) == 6
    assert all(0 < h < s for h, s in zip(t.host_steps_s, t.decode_steps_s))


def test_step_stats_time_the_step_and_its_forward(tiny_model_dir):
    from minivllm import SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu")
    engine = llm.llm_engine
    engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        _, stats = engine.step_with_stats()
        assert 0 < stats.forward_seconds < stats.step_seconds


def test_busy_core_runs_a_process_and_stops_it():
    from minivllm.bench._harness import busy_core

    with busy_core() as proc:
        assert proc.poll() is None  # running
    assert proc.poll() is not None  # stopped on the way out
    with busy_core(False) as none:
        assert none is None


def test_the_header_names_a_build_for_another_cpu(monkeypatch):
    """A figure measured with the kernels built for another CPU (MINIVLLM_CPU_ARCH) says so."""
    from minivllm.bench._harness import describe_machine, machine

    monkeypatch.delenv("MINIVLLM_CPU_ARCH", raising=False)
    assert "built for" not in describe_machine()
    monkeypatch.setenv("MINIVLLM_CPU_ARCH", "x86-64-v3")
    info = machine()
    assert info["kernels_built_for"] == "x86-64-v3"
    assert f"C++ kernels built for x86-64-v3, torch's for {info['torch_cpu_capability']}" \
        in describe_machine(info)


def test_kernel_time_is_at_most_the_profiled_step(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu")
    per = latency.kernel_seconds_per_decode_step(
        llm, latency.random_prompts(1, 10, llm.llm_engine.vocab_size), 5)
    kernels = sum(per[op] for op in latency.KERNEL_OPS)
    assert 0 < kernels < per["step_profiled"]
    assert per["attention"] > 0 and per["linear"] > 0
    # The leaf operators sit inside the op ranges: less time, but not none.
    assert 0 < per["kernel_leaves"] < kernels


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit, match="--output-len must be >= 1, got 0"):
        latency.main(["--output-len", "0"])


def test_make_llm_quantizes_the_projections(tiny_model_dir):
    from minivllm.model.quantization import QuantizedWeight

    llm = latency.make_llm(str(tiny_model_dir("llama")), "float32", "int8", device="cpu")
    model = llm.llm_engine.executor.worker.model
    weights = [m.weight for m in model.modules() if hasattr(m, "weight")]
    assert any(isinstance(w, QuantizedWeight) for w in weights)
    llm.shutdown()


def test_cpu_parallel_modes_are_measured_in_one_run(tiny_model_dir, tmp_path, capsys):
    """``--cpu-parallel adaptive openmp``: the fast path once in each thread mode, the
    ratio printed, and the mode the kernels had before restored afterwards."""
    from minivllm.fast import cpu_ops

    if not cpu_ops.available():
        pytest.skip(f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")
    before = cpu_ops.ops().cpu_parallel_mode("")
    out = tmp_path / "latency.json"
    assert latency.main(["--model", str(tiny_model_dir("llama")), "--dtype", "float32",
                         "--device", "cpu", "--backend", "fast", "--input-len", "8",
                         "--output-len", "4", "--num-iters", "1", "--no-profile",
                         "--cpu-parallel", "adaptive", "openmp", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    import json

    paths = json.loads(out.read_text())["results"][0]["paths"]
    if "fast" in paths:  # the tiny model takes the fast path on a CPU with the C++ ops
        assert "fast/openmp" in paths and "threads: adaptive decodes" in text
    assert cpu_ops.ops().cpu_parallel_mode("") == before


def test_fast_and_plain_paths_alternate_and_report_their_spread(tiny_model_dir, tmp_path,
                                                                monkeypatch):
    """``--num-iters 3``: fast, plain, plain, fast, fast, plain (each round starts at the
    next path), every figure the median of its path's runs, the decode spread beside it."""
    import json

    from minivllm.worker.worker import Worker

    built: list[bool] = []
    build = Worker.build_model_runner
    monkeypatch.setattr(Worker, "build_model_runner",
                        lambda self, enforce_eager: built.append(enforce_eager)
                        or build(self, enforce_eager))
    out = tmp_path / "latency.json"
    assert latency.main(["--model", str(tiny_model_dir("llama")), "--dtype", "float32",
                         "--device", "cpu", "--backend", "fast", "--input-len", "8",
                         "--output-len", "4", "--num-iters", "3", "--no-profile",
                         "--out", str(out)]) == 0
    paths = json.loads(out.read_text())["results"][0]["paths"]
    timed = built[2:-1]  # after the engine's own build and the first "fast" build, before
    if "fast" in paths:  # the last rebuild: the timed runs' builds, in order
        assert timed == [False, True, True, False, False, True]
    assert all(0 <= p["decode_spread"] and p["decode_ms_per_step"] > 0 for p in paths.values())
