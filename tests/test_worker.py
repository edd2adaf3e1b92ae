"""The worker owns the block table: it follows the scheduler, and stale state cannot be reused.

- Engine level: after every step of a run with chunked prefill, preemption
  and an abort, the worker's table holds exactly the requests the scheduler
  has running, with exactly the blocks the scheduler gave them.
- Worker level: a request's row is gone once its removal arrives, and a
  recycled row is never read under the old id; each step builds a new, frozen
  ``AttentionMetadata`` that later steps do not change.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minivllm import SamplingParams, backend
from minivllm.engine.config import WorkerConfig
from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.metadata import StepInput
from minivllm.worker.worker import Worker

BLOCK_SIZE = 4


def _kernels_ref() -> dict[str, str]:
    """The backend under test, with ref kernels (this file tests host-side state)."""
    spec = {name: backend.resolve(name) for name in backend.COMPONENTS}
    spec.update({n: "ref" for n, k in backend.COMPONENTS.items() if k == "kernel"})
    return spec


def test_worker_table_follows_the_scheduler(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir("llama")), backend=_kernels_ref(), dtype="float32",
        device="cpu", block_size=BLOCK_SIZE, max_model_len=36, max_num_seqs=4,
        max_num_batched_tokens=12, num_gpu_blocks_override=9,  # 36 tokens: all it holds
    ))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 1], [40, 41], [3] * 11, [9]]
    for i, p in enumerate(prompts):
        engine.add_request(None, p, SamplingParams(max_tokens=8, ignore_eos=True),
                           request_id=f"r{i}")
    tables = engine.executor.worker.block_tables
    saw_preemption = aborted = False
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        _, stats = engine.step_with_stats()
        saw_preemption |= bool(stats.preempted_req_ids)
        if step == 3 and not aborted:
            engine.abort_request("r1")  # its row goes with the next step's changes
            aborted = True
        # The scheduler's host-side record and the worker's table agree, row for row.
        sched = engine.scheduler
        for req in sched.running:
            assert tables.get_block_ids(req.request_id) == sched.get_block_ids(req.request_id)
        for req in sched.waiting:  # preempted ones lost their rows in the same step
            assert not tables.has_request(req.request_id)
    assert not engine.has_unfinished_requests()
    assert saw_preemption, "the pool is meant to be small enough to preempt"
    engine.step()  # an empty step still delivers the last removals
    for i in range(len(prompts)):
        assert not tables.has_request(f"r{i}")


def _step(req_ids, new, blocks, removed=(), query_lens=None, seq_lens=None) -> StepInput:
    query_lens = query_lens or (1,) * len(req_ids)
    seq_lens = seq_lens or query_lens
    n = sum(query_lens)
    return StepInput(
        req_ids=tuple(req_ids), new_req_ids=frozenset(new),
        new_block_ids=tuple(tuple(b) for b in blocks), removed_req_ids=tuple(removed),
        query_lens=tuple(query_lens), seq_lens=tuple(seq_lens),
        input_ids=torch.arange(n, dtype=torch.int64),
        positions=torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
        if n else torch.zeros(0, dtype=torch.int64),
        logits_indices=torch.zeros(0, dtype=torch.int64),
    )


@pytest.fixture()
def worker(tiny_model_dir) -> Worker:
    w = Worker(WorkerConfig(str(tiny_model_dir("llama")), torch.float32, "cpu"), _kernels_ref())
    w.init_kv_cache(16, BLOCK_SIZE, max_num_reqs=2, max_num_blocks_per_req=4)
    return w


def test_stale_rows_and_metadata_cannot_be_reused(worker: Worker) -> None:
    first = worker.prepare_model_input(
        _step(["a", "b"], {"a", "b"}, [[3, 7], [5]], query_lens=(6, 2), seq_lens=(6, 2)))
    md1 = first.attn_metadata
    table1 = md1.block_tables.clone()
    assert table1.tolist() == [[3, 7, 0, 0], [5, 0, 0, 0]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        md1.seq_lens_host = (1, 1)  # one step's metadata is never patched for the next

    # "a" finishes; a new request takes its recycled row in the same step.
    second = worker.prepare_model_input(
        _step(["b", "c"], {"c"}, [[], [9]], removed=["a"], seq_lens=(3, 1)))
    assert second.attn_metadata is not md1
    assert second.attn_metadata.block_tables.tolist() == [[5, 0, 0, 0], [9, 0, 0, 0]]
    assert torch.equal(md1.block_tables, table1), "an old step's metadata changed under it"
    assert second.attn_metadata.slot_mapping.tolist() == [5 * BLOCK_SIZE + 2, 9 * BLOCK_SIZE]

    # The finished request's row is gone: naming it again is an error, not "c"'s blocks.
    with pytest.raises(ValueError, match="'a'"):
        worker.prepare_model_input(_step(["a"], set(), [[]], seq_lens=(7,)))
    # A "new" request that still has a row means the table is out of step: refused.
    with pytest.raises(ValueError, match="already"):
        worker.prepare_model_input(_step(["b"], {"b"}, [[1]], seq_lens=(1,)))
    # Removal of an id without a row (aborted while waiting) is not an error.
    worker.update_block_tables(_step([], set(), [], removed=["never-ran"]))
    assert worker.block_tables.get_block_ids("c") == [9]
