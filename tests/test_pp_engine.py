"""Pipeline parallelism: the layer split, the stages, micro-batches in flight, failures.

Under ``--backend=ref`` ``LLM(..., pipeline_parallel_size=P)`` simulates the
stages one after another in one process (:class:`UniProcExecutor`); under
``--backend=fast`` every stage is a real gloo process (:class:`MultiprocExecutor`).
The oracle is transformers' greedy continuation; the simulation and the real
processes must also agree bit for bit on the same steps (the real executor
runs at tp=1, where it accepts the ref linear layers too). The failure test
always uses real processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from test_tp_engine import _gone

from minivllm import backend
from minivllm.backend import COMPONENTS
from minivllm.engine.config import EngineConfig, WorkerConfig
from minivllm.executor.multiproc_executor import MultiprocExecutor
from minivllm.executor.ranks import simulates_all_ranks
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.pp_stages import get_pp_indices, stage_layer_ranges, valid_pp_sizes

BLOCK_SIZE = 4


def spec_with_ref_kernels() -> dict[str, str]:
    """The backend under test for host components (linear, the model runner), ref kernels on the
    CPU: the thing under test is how the layers are split and run, not the kernels."""
    spec = {name: backend.resolve(name) for name in COMPONENTS}
    spec.update({n: "ref" for n, k in COMPONENTS.items() if k == "kernel"})
    return spec


# --------------------------------------------------------------------------
# The layer split
# --------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 7, 12, 30, 31, 32])
def test_get_pp_indices_contract(num_layers: int) -> None:
    for pp in range(1, num_layers + 1):
        ranges = [get_pp_indices(num_layers, r, pp) for r in range(pp)]
        sizes = [end - start for start, end in ranges]
        # Consecutive, non-empty, covering every layer once.
        assert [s for s, _ in ranges] == [0] + [e for _, e in ranges[:-1]]
        assert ranges[-1][1] == num_layers and min(sizes) >= 1
        # Even up to one layer; the last stage (LM head) never gets an extra one, and
        # the extra ones sit on the stages just before it.
        base, extra = divmod(num_layers, pp)
        assert sizes[-1] == base
        assert sizes == [base + (pp - 1 - extra <= r < pp - 1) for r in range(pp)]
    assert stage_layer_ranges(num_layers, 1, None, get_pp_indices) == [(0, num_layers)]


def test_layer_partition_override_and_refusals(monkeypatch) -> None:
    rule = get_pp_indices
    assert stage_layer_ranges(5, 3, None, rule) == [(0, 2), (2, 4), (4, 5)]
    assert stage_layer_ranges(5, 3, "1,1,3", rule) == [(0, 1), (1, 2), (2, 5)]
    assert stage_layer_ranges(5, 2, (4, 1), rule) == [(0, 4), (4, 5)]
    # The environment is read once, into the engine's config; an argument wins.
    monkeypatch.setenv("MINIVLLM_PP_LAYER_PARTITION", "3,1,1")
    assert EngineConfig(pipeline_parallel_size=3).pp_layer_partition == (3, 1, 1)
    assert EngineConfig(pipeline_parallel_size=3,
                        pp_layer_partition="1,3,1").pp_layer_partition == (1, 3, 1)
    monkeypatch.delenv("MINIVLLM_PP_LAYER_PARTITION")
    assert EngineConfig(pipeline_parallel_size=3).pp_layer_partition is None
    for bad in ("2,2", "2,2,2", "5,0,0", "a,b,c", (1, 1, 3.0)):
        with pytest.raises(ValueError, match="pp_layer_partition"):
            stage_layer_ranges(5, 3, bad, rule)
    with pytest.raises(ValueError, match=r"pp sizes that work: \[1, 2, 3\]"):
        stage_layer_ranges(3, 4, None, rule)
    assert valid_pp_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        stage_layer_ranges(3, 0, None, rule)
    # A wrong rule (a student's) is caught before any weight is loaded.
    with pytest.raises(ValueError, match="not consecutive"):
        stage_layer_ranges(5, 2, None, lambda n, r, p: (0, 3) if r == 0 else (2, 5))


@pytest.mark.parametrize("impl", ["ref", "fast"])
def test_schedule_leaves_the_requests_in_flight_out(impl: str) -> None:
    """A request in flight is neither scheduled again nor preempted, and still counts
    against max_num_seqs; ``running`` keeps its order and nothing in the scheduler is
    swapped for the call."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams

    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64)
    sched = backend.get("scheduler", impl).Scheduler(
        config, CacheConfig(block_size=4, num_blocks=64), components=backend.as_components(impl))
    reqs = [Request(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), 0) for i in range(4)]
    for r in reqs[:2]:
        sched.add_request(r)
    first = sched.schedule()
    assert [r.request_id for r in first.scheduled_requests] == ["r0", "r1"]
    for r in reqs[2:]:
        sched.add_request(r)
    second = sched.schedule(in_flight={"r0", "r1"})
    # r0, r1 in flight: only one more fits under max_num_seqs=3.
    assert [r.request_id for r in second.scheduled_requests] == ["r2"]
    assert [r.request_id for r in sched.running] == ["r0", "r1", "r2"]
    assert sched.scheduler_config is config and config.max_num_seqs == 3


@pytest.mark.parametrize("impl", ["ref", "fast"])
def test_a_full_pool_never_preempts_a_request_in_flight(impl: str) -> None:
    """With the pool short, the victim is the newest request NOT in flight (here the
    request itself), never one whose step is still in the pipeline."""
    from minivllm.config import CacheConfig, SchedulerConfig
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams

    sched = backend.get("scheduler", impl).Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=4), components=backend.as_components(impl))
    a = Request("a", list(range(1, 9)), SamplingParams(max_tokens=8), 0)
    b = Request("b", list(range(11, 19)), SamplingParams(max_tokens=8), 0)
    for r in (a, b):
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), {"a": 7, "b": 7})  # 2 blocks each: pool full
    out = sched.schedule(in_flight={"b"})  # a needs a third block; b's step is in flight
    assert list(out.preempted_req_ids) == ["a"] and not out.scheduled_requests
    assert [r.request_id for r in sched.running] == ["b"]


# --------------------------------------------------------------------------
# The whole engine against transformers
# --------------------------------------------------------------------------

# (arch, config overrides, tp, pp, engine overrides): 5 layers never divide by 2 or 3.
# Chunked prefill from a small token budget, preemption from a small pool, prefix
# caching from prompts that share a prefix. A small pool's max_model_len is what it holds
# (14 blocks of 4): the engine refuses a pool too small for one max-length request.
CASES = [
    pytest.param("llama", {}, 1, 2, dict(max_num_batched_tokens=12), id="llama-gqa-pp2"),
    pytest.param("qwen2", dict(tie_word_embeddings=True), 1, 3,
                 dict(max_num_batched_tokens=16, num_gpu_blocks_override=14, max_model_len=56),
                 id="qwen2-tied-pp3"),
    pytest.param("llama", {}, 2, 2, dict(max_num_batched_tokens=12, num_gpu_blocks_override=14,
                                         max_model_len=56), id="llama-tp2xpp2"),
]


@pytest.mark.parametrize("arch,overrides,tp,pp,engine_kw", CASES)
def test_llm_pp_greedy_matches_transformers(tiny_model_dir, arch, overrides, tp, pp,
                                            engine_kw) -> None:
    from test_engine import greedy, hf_greedy, random_prompts

    from minivllm import LLM

    path = tiny_model_dir(arch, num_hidden_layers=5, **overrides)
    shared = random_prompts(1, [9], seed=11)[0]
    prompts = [shared + p for p in random_prompts(4, [3, 14, 1, 6], seed=pp)] + [shared]
    llm = LLM(str(path), backend=spec_with_ref_kernels(), tensor_parallel_size=tp,
              pipeline_parallel_size=pp, dtype="float32", device="cpu",
              block_size=BLOCK_SIZE, **{"max_model_len": 128, **engine_kw})
    executor = llm.llm_engine.executor
    procs = list(executor.procs) if isinstance(executor, MultiprocExecutor) else []
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10),
                            use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 10)
    if simulates_all_ranks(spec_with_ref_kernels()):
        assert isinstance(executor, UniProcExecutor) and len(executor.workers) == pp
    else:
        assert isinstance(executor, MultiprocExecutor) and len(procs) == tp * pp - 1
        assert [p.exitcode for p in procs] == [0] * len(procs)  # a clean shutdown
        assert all(_gone(p.pid) for p in procs)


# --------------------------------------------------------------------------
# The simulation equals the real processes, bit for bit
# --------------------------------------------------------------------------


def test_ref_pipeline_equals_real_pipeline_exactly(tiny_model_dir) -> None:
    from test_tp_engine import NUM_BLOCKS, Batches

    path = str(tiny_model_dir("llama", num_hidden_layers=5))
    spec = spec_with_ref_kernels()
    runs, memory, timelines = [], [], []
    for cls in (UniProcExecutor, MultiprocExecutor):
        ex = cls(WorkerConfig(path, torch.float32, "cpu", pipeline_parallel_size=3), spec)
        with ex:
            ex.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, max_num_reqs=4, max_num_blocks_per_req=8)
            batches = Batches(seed=7, vocab=ex.hf_config.vocab_size)
            inputs = [batches.next_input() for _ in range(4)]
            pending = [ex.execute_model(s) for s in inputs[:3]]  # in flight
            logits = [p.result().logits for p in pending] + [
                ex.execute_model(inputs[3]).result().logits]
            runs.append(logits)
            memory.append(ex.memory_per_rank())
            timelines.append(ex.stage_timeline())
    with UniProcExecutor(WorkerConfig(path, torch.float32, "cpu"), spec) as whole:
        whole.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, max_num_reqs=4, max_num_blocks_per_req=8)
        batches = Batches(seed=7, vocab=whole.hf_config.vocab_size)
        expected = [whole.execute_model(batches.next_input()).result().logits
                    for _ in range(4)]
        whole_memory = whole.memory_per_rank()[0]
    for step, (sim, real, one) in enumerate(zip(*runs, expected)):
        assert torch.equal(sim, real), f"step {step}: simulation != real processes"
        torch.testing.assert_close(sim, one, atol=1e-5, rtol=1e-5)
    # Layers 0-1, 2-3, 4 per stage: KV cache 2:2:1, and no stage holds the whole model.
    assert memory[0] == memory[1]
    kv = [m["kv_cache"] for m in memory[0]]
    assert kv[0] == kv[1] == 2 * kv[2] and sum(kv) == whole_memory["kv_cache"]
    assert all(m["weights"] < whole_memory["weights"] for m in memory[0])
    # One record per stage per micro-batch, each stage after the one before it.
    for records in timelines:
        assert [(t.batch, t.pp_rank) for t in records] == [(b, s) for b in range(4)
                                                           for s in range(3)]
        for a, b in zip(records, records[1:]):
            if a.batch == b.batch:
                assert a.end <= b.start


def test_tp_pp_sizes_are_refused_with_the_sizes_that_work(tiny_model_dir) -> None:
    from minivllm import LLM

    path = str(tiny_model_dir("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"pp sizes that work: \[1, 2, 3\]"):
        LLM(path, backend=spec_with_ref_kernels(), pipeline_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match=r"tp sizes that work: \[1, 2, 4\]"):
        LLM(path, backend=spec_with_ref_kernels(), tensor_parallel_size=3,
            pipeline_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="pp_layer_partition"):
        LLM(path, backend=spec_with_ref_kernels(), pipeline_parallel_size=2,
            pp_layer_partition="1,1", device="cpu")


# --------------------------------------------------------------------------
# Failures: real processes
# --------------------------------------------------------------------------


def test_killed_stage_fails_every_request_and_leaves_nothing_behind(tiny_model_dir) -> None:
    from minivllm import LLM, SamplingParams

    spec = spec_with_ref_kernels()
    if simulates_all_ranks(spec):
        spec["linear"] = "fast"  # real processes: one per stage
    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=5)), backend=spec,
              pipeline_parallel_size=3, dtype="float32", device="cpu", max_model_len=256,
              block_size=BLOCK_SIZE)
    try:
        executor = llm.llm_engine.executor
        procs = list(executor.procs)
        threading.Timer(0.5, os.kill, (procs[0].pid, signal.SIGKILL)).start()  # the middle
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"pipeline-parallel rank 1 \(stage 1, tp rank 0\) "
                                               rf"\(pid {procs[0].pid}\) died: killed by SIGKILL"):
            for _ in range(1000):  # long enough that the kill lands mid-generate
                llm.generate([{"prompt_token_ids": [1, 2, 3 + i]} for i in range(4)],
                             SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 10.5  # the kill, then at most 10 s
        assert not llm.llm_engine.has_unfinished_requests()  # every request was aborted
        # The last stage, which waited on the dead one, was stopped too, before shutdown.
        assert not any(p.is_alive() for p in procs)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while not all(_gone(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p.pid) for p in procs)


def test_a_workers_timeline_keeps_only_its_newest_records(tiny_model_dir, monkeypatch):
    """The per-step StageTiming records are bounded (a server runs for days): the worker
    keeps the newest TIMELINE_STEPS, in order, and ``clear`` empties them."""
    from test_engine import greedy, make_llm

    from minivllm.worker import worker as worker_module

    monkeypatch.setattr(worker_module, "TIMELINE_STEPS", 5)
    llm = make_llm(tiny_model_dir("llama"))
    llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(12), use_tqdm=False)
    executor = llm.llm_engine.executor
    records = executor.stage_timeline()
    batches = [r.batch for r in records]
    assert batches == list(range(batches[-1] - 4, batches[-1] + 1)), batches
    assert batches[-1] >= 11  # a prefill and 11 decodes at least
    executor.stage_timeline(clear=True)
    assert executor.stage_timeline() == []
