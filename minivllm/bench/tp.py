"""Tensor-parallel benchmark: ``python -m minivllm.bench tp``.

Times the forward step (``executor.execute_model``) of one model at
``tp_size=1`` (one in-process worker) and at ``tp_size=N`` (real worker
processes, :class:`~minivllm.executor.multiproc_executor.MultiprocExecutor`), for a
prefill batch and a decode batch, and reports:

- step time and tokens/s for each, and the tp=N / tp=1 speed-up;
- the all-reduce share: wall time rank 0 spends inside collectives (the two
  all-reduces per layer, the embedding's all-reduce and the logits gather,
  timed into a :class:`minivllm.distributed.CollectiveStats` given to the executor) divided
  by the step time. On a CPU this includes waiting for the slowest rank.

The model: SmolLM2-135M if it is in the cache (9 query heads, 3 KV heads, so
``tp=3``), else a random-weight Llama of similar size with 8 heads and 4 KV
heads (``tp=2``); ``--model`` picks any local model.

Each rank gets ``cores / tp`` torch threads (at least 1), and the tp=1 run
gets the same per-rank budget: the comparison is "one device against tp
devices", as with GPUs, where a core plays the part of a GPU. The all-reduces
go through gloo over the loopback interface, so their share is much larger
than over NVLink.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minivllm.config import cdiv
from minivllm.metadata import StepInput

BLOCK_SIZE = 16


def synthetic_input(num_seqs: int, query_len: int, context_len: int, vocab: int,
                    seed: int = 0, name: str = "seq", first_block: int = 0) -> StepInput:
    """``num_seqs`` new sequences of ``context_len`` cached tokens plus ``query_len`` new ones.

    Each sequence owns its own consecutive blocks, sent as the block-table
    changes of a first step (every sequence new); the cached K/V are whatever
    the cache holds (this is a timing workload, not a correctness one). Run
    it once, then :func:`repeat_step` as often as you like. Requests are named
    ``{name}{i}`` and use blocks from ``first_block`` on.
    """
    g = torch.Generator().manual_seed(seed)
    seq_len = context_len + query_len
    blocks_per_seq = cdiv(seq_len, BLOCK_SIZE)
    req_ids = tuple(f"{name}{i}" for i in range(num_seqs))
    pos = torch.arange(context_len, seq_len).repeat(num_seqs)  # (T,)
    return StepInput(
        req_ids=req_ids,
        new_req_ids=frozenset(req_ids),
        new_block_ids=tuple(
            tuple(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq))
            for i in range(num_seqs)),
        removed_req_ids=(),
        query_lens=(query_len,) * num_seqs,
        seq_lens=(seq_len,) * num_seqs,
        input_ids=torch.randint(0, vocab, (num_seqs * query_len,), generator=g),
        positions=pos,
        logits_indices=torch.arange(1, num_seqs + 1) * query_len - 1,
    )


def repeat_step(step_input: StepInput) -> StepInput:
    """The same batch again, with no block-table changes (the rows exist already)."""
    return dataclasses.replace(step_input, new_req_ids=frozenset(),
                               new_block_ids=((),) * len(step_input.req_ids))


def num_blocks_needed(step_input: StepInput) -> int:
    """The KV pool a synthetic step needs: one past its highest block id."""
    return 1 + max(b for blocks in step_input.new_block_ids for b in blocks)


def save_random_llama(path: Path, hidden: int = 512, heads: int = 8, kv_heads: int = 4,
                      intermediate: int = 1536, layers: int = 12, vocab: int = 16384) -> Path:
    """A random-weight Llama (HF format, byte-level tokenizer) for timing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(path)
    return path


def time_steps(executor, step_input: StepInput, steps: int,
               stats: Any) -> tuple[float, float]:
    """(median step seconds, collective seconds per step) over ``steps`` runs.

    The first run (untimed: a warm-up) registers the step's requests in every
    rank's block table; the timed ones repeat the batch without changes.
    ``stats``: the :class:`~minivllm.distributed.CollectiveStats` rank 0's
    collectives add to (None with one rank: no collectives).
    """
    executor.execute_model(step_input).result()  # warm-up
    again = repeat_step(step_input)
    times, comm = [], []
    for _ in range(steps):
        if stats is not None:
            stats.reset()
        start = time.perf_counter()
        executor.execute_model(again).result()
        times.append(time.perf_counter() - start)
        comm.append(0.0 if stats is None else stats.seconds)
    order = sorted(range(steps), key=times.__getitem__)
    mid = order[steps // 2]
    return times[mid], comm[mid]


def run(model: str, tp: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Step times of the prefill and decode workloads at ``tp``."""
    from minivllm import distributed
    from minivllm.engine.config import WorkerConfig
    from minivllm.executor.multiproc_executor import MultiprocExecutor
    from minivllm.executor.uniproc_executor import UniProcExecutor

    config = WorkerConfig(model, getattr(torch, args.dtype), args.device,
                          tensor_parallel_size=tp)
    stats = None if tp == 1 else distributed.CollectiveStats()
    if tp == 1:
        executor = UniProcExecutor(config, args.backend)
    else:
        executor = MultiprocExecutor(config, args.backend, collective_stats=stats)
    try:
        vocab = executor.hf_config.vocab_size
        prefill = synthetic_input(args.prefill_seqs, args.prefill_len, 0, vocab, name="prefill")
        decode = synthetic_input(args.decode_seqs, 1, args.decode_context, vocab, name="decode",
                                 first_block=num_blocks_needed(prefill))
        executor.init_kv_cache(num_blocks_needed(decode), BLOCK_SIZE,
                               max_num_reqs=args.prefill_seqs + args.decode_seqs)
        return {"prefill": time_steps(executor, prefill, args.steps, stats),
                "decode": time_steps(executor, decode, args.steps, stats)}
    finally:
        executor.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m minivllm.bench tp", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="model name or directory (default: SmolLM2 if cached, else random Llama)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size to compare with 1")
    p.add_argument("--random", action="store_true", help="use the random 8-head Llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto",
                   help="backend spec; the linear layers must be fast for tp > 1 (auto: fast)")
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--decode-seqs", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)

    if args.backend == "auto" and torch.device(args.device).type == "cpu":
        # "auto" picks Triton kernels wherever CUDA exists, but this model runs on the
        # CPU: keep the kernels ref (the linear layers, host-side, are fast either way).
        from minivllm.backend import COMPONENTS

        args.backend = {n: "ref" if k == "kernel" else "fast" for n, k in COMPONENTS.items()}
    tmp = None
    model, tp = args.model, args.tp
    if model is None and not args.random:
        from minivllm.model import registry

        cached = registry.cached_model_dir("smollm2")
        if cached is not None:
            model, tp = str(cached), tp or 3  # 9 query heads / 3 KV heads: tp=2 cannot split it
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="minivllm-bench-tp-")
        model = str(save_random_llama(Path(tmp.name)))
    tp = tp or 2
    # Each rank gets cores / tp threads (the executor's choice); give tp=1 the same
    # per-rank budget, so that the comparison is "1 device vs tp devices" as on GPUs.
    threads = max(1, len(os.sched_getaffinity(0)) // tp)
    torch.set_num_threads(threads)
    print(f"model {model}, tp=1 vs tp={tp}, {args.dtype} on {args.device}, "
          f"{threads} thread(s) per rank")
    results = {t: run(model, t, args) for t in (1, tp)}
    tokens = {"prefill": args.prefill_seqs * args.prefill_len, "decode": args.decode_seqs}
    print(f"{'workload':<9} {'tp':>3} {'step ms':>9} {'tokens/s':>10} {'speed-up':>9} "
          f"{'collective share':>17}")
    for name in ("prefill", "decode"):
        base = results[1][name][0]
        for t in (1, tp):
            step, comm = results[t][name]
            print(f"{name:<9} {t:>3} {step * 1e3:>9.1f} {tokens[name] / step:>10.0f} "
                  f"{base / step:>8.2f}x {comm / step:>16.0%}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
