"""Pipeline-parallel benchmark: ``minivllm bench pp``.

Three measurements, each from one run on this machine:

1. **Throughput** of the whole engine (``LLM.generate``: scheduler, batch
   queue, sampler) at ``pp=1``, ``pp=2`` and ``tp=2``, on the same requests:
   ``--num-prompts`` random prompts of ``--input-len`` tokens, each generating
   ``--output-len`` tokens (greedy, ``ignore_eos``). Output tokens/s, and the
   ratio to ``pp=1``.
2. **The bubble.** ``m`` micro-batches (disjoint requests, each a prefill of
   ``--micro-batch-seqs x --micro-batch-len`` tokens) go through a ``pp=P``
   executor back to back, with at most ``max_concurrent_batches`` (= ``P``)
   in flight, as the engine's batch queue keeps them. Every rank records
   when it had a micro-batch's inputs and when its output was ready
   (:meth:`~minivllm.executor.multiproc_executor.MultiprocExecutor.stage_timeline`,
   ``time.time()``, one clock for the ranks of one host). The *measured*
   bubble is the idle share of the stages over the span from the first start
   to the last end::

       bubble = 1 - sum(stage busy time) / (P * span)

   against the textbook (GPipe) ``(P - 1) / (m + P - 1)``, which assumes
   equal stages and free communication.
3. **Memory per rank**: the bytes of weights and KV cache each rank holds
   (``Worker.memory_bytes``), for each configuration of (1).

The model: ``--model``, else random weights at SmolLM2-135M's shape (30
layers, hidden 576, intermediate 1536, vocabulary 49152) with 8 query / 4 KV
heads instead of 9 / 3, so that ``tp=2`` can split it too (SmolLM2 itself
splits only at tp 1 and 3). Every rank gets ``cores / 2`` torch threads and
``pp=1`` the same per-rank budget: "one device against two", with a core
standing in for a GPU. On a CPU the point-to-point sends and the all-reduces
go through gloo over loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.bench.tp import num_blocks_needed, repeat_step, save_random_llama, synthetic_input

BLOCK_SIZE = 16


def textbook_bubble(pp_size: int, num_micro_batches: int) -> float:
    """GPipe's idle fraction ``(p - 1) / (m + p - 1)`` of ``p`` equal stages and ``m`` micro-batches."""
    return (pp_size - 1) / (num_micro_batches + pp_size - 1)


def measured_bubble(records: list[Any], pp_size: int) -> float:
    """The stages' idle share of the span, from per-rank :class:`StageTiming` records.

    A stage counts once (its tensor-parallel rank 0); its busy time is the sum
    of its records' ``end - start``; the span runs from the first start to
    the last end over every stage.
    """
    stage = [r for r in records if r.tp_rank == 0]
    if not stage:
        raise ValueError("no stage timings: no micro-batch with tokens ran")
    span = max(r.end for r in stage) - min(r.start for r in stage)
    busy = sum(r.end - r.start for r in stage)
    return 1.0 - busy / (pp_size * span) if span > 0 else 0.0


@dataclass
class ThroughputResult:
    """One configuration's end-to-end run."""

    name: str
    tp: int
    pp: int
    seconds: float
    output_tokens: int
    memory: list[dict[str, int]]  # per rank, rank order

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _backend(args: argparse.Namespace) -> Any:
    from minivllm.backend import COMPONENTS

    if args.backend != "auto" or torch.device(args.device).type != "cpu" \
            or not torch.cuda.is_available():
        return args.backend
    # "auto" picks Triton kernels wherever CUDA exists, but these ranks run on the CPU.
    return {n: "ref" if k == "kernel" else "fast" for n, k in COMPONENTS.items()}


def run_throughput(model: str, name: str, tp: int, pp: int,
                   args: argparse.Namespace) -> ThroughputResult:
    """``LLM.generate`` of the benchmark's requests at ``tp x pp`` ranks."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model, backend=_backend(args), dtype=args.dtype, device=args.device,
              tensor_parallel_size=tp, pipeline_parallel_size=pp,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.num_prompts, enforce_eager=True)
    try:
        vocab = llm.llm_engine.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.input_len,),
                                                      generator=g).tolist()}
                   for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True),
                     use_tqdm=False)  # warm-up (first-call allocations)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        memory = llm.llm_engine.executor.memory_per_rank()
    finally:
        llm.shutdown()
    return ThroughputResult(name, tp, pp, seconds,
                            sum(len(o.outputs[0].token_ids) for o in outs), memory)


def run_bubble(model: str, pp: int, micro_batches: list[int],
               args: argparse.Namespace) -> list[tuple[int, float, float, list[Any]]]:
    """``(m, measured, textbook, records)`` for each ``m`` in ``micro_batches``, at ``pp`` stages."""
    from minivllm import backend
    from minivllm.engine.config import WorkerConfig
    from minivllm.executor.multiproc_executor import MultiprocExecutor

    dtype = getattr(torch, args.dtype)
    with backend.use_backend(_backend(args)):
        executor = MultiprocExecutor(WorkerConfig(model, dtype, args.device,
                                                  pipeline_parallel_size=pp))
    try:
        vocab = executor.hf_config.vocab_size
        batches, first = [], 0
        for i in range(max(micro_batches)):
            b = synthetic_input(args.micro_batch_seqs, args.micro_batch_len, 0, vocab, seed=i,
                                name=f"mb{i}-", first_block=first)
            batches.append(b)
            first = num_blocks_needed(b)
        executor.init_kv_cache(first, BLOCK_SIZE, max_num_reqs=len(batches) * args.micro_batch_seqs)
        run_micro_batches(executor, batches)  # registers every request on every rank
        again = [repeat_step(b) for b in batches]
        out = []
        for m in micro_batches:
            executor.stage_timeline(clear=True)
            run_micro_batches(executor, again[:m])
            records = executor.stage_timeline(clear=True)
            out.append((m, measured_bubble(records, pp), textbook_bubble(pp, m), records))
        return out
    finally:
        executor.shutdown()


def run_micro_batches(executor: Any, batches: list[Any]) -> None:
    """Send ``batches`` back to back, at most ``max_concurrent_batches`` in flight; wait for all."""
    in_flight: list[Any] = []
    for b in batches:
        if len(in_flight) == executor.max_concurrent_batches:
            in_flight.pop(0).result()
        in_flight.append(executor.execute_model(b))
    for pending in in_flight:
        pending.result()


def format_tables(results: list[ThroughputResult], bubbles: list[tuple], pp: int) -> str:
    """The three small tables, as text."""
    base = results[0].tokens_per_s
    lines = [f"{'config':<8} {'ranks':>5} {'output tok/s':>13} {'vs pp=1':>8} {'seconds':>8}"]
    for r in results:
        lines.append(f"{r.name:<8} {r.tp * r.pp:>5} {r.tokens_per_s:>13.1f} "
                     f"{r.tokens_per_s / base:>7.2f}x {r.seconds:>8.2f}")
    lines += ["", f"bubble at pp={pp} (from each rank's timestamps)",
              f"{'m':>4} {'measured':>9} {'(p-1)/(m+p-1)':>14}"]
    for m, measured, textbook, _ in bubbles:
        lines.append(f"{m:>4} {measured:>9.1%} {textbook:>14.1%}")
    lines += ["", "memory per rank (MiB: weights + KV cache)",
              f"{'config':<8} " + " ".join(f"{'rank ' + str(i):>15}" for i in range(2))]
    for r in results:
        cells = [f"{m['weights'] / 2**20:>7.1f} + {m['kv_cache'] / 2**20:>5.1f}"
                 for m in r.memory]
        lines.append(f"{r.name:<8} " + " ".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="minivllm bench pp", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="model directory (default: random weights at SmolLM2's shape, 8/4 heads)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto",
                   help="backend spec; the linear layers must be fast (one process per rank)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--micro-batches", default="1,2,4,8",
                   help="numbers of micro-batches m for the bubble table (default %(default)s)")
    p.add_argument("--micro-batch-seqs", type=int, default=2)
    p.add_argument("--micro-batch-len", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--out", default="results/bench_pp.json")
    args = p.parse_args(argv)
    ms = [int(m) for m in args.micro_batches.split(",")]
    for name in ("num_prompts", "input_len", "output_len", "micro_batch_seqs",
                 "micro_batch_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(m < 1 for m in ms):
        raise SystemExit(f"--micro-batches must be ints >= 1, got {args.micro_batches!r}")

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="minivllm-bench-pp-")
        model = str(save_random_llama(Path(tmp.name), hidden=576, heads=8, kv_heads=4,
                                      intermediate=1536, layers=30, vocab=49152))
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # pp=1 gets one rank's share, as the ranks do
    try:
        print(f"model {args.model or 'random SmolLM2-shaped Llama (8/4 heads)'}, {args.dtype} on "
              f"{args.device}, {threads} thread(s) per rank, load average "
              f"{os.getloadavg()[0]:.2f}")
        results = [run_throughput(model, name, tp, pp, args)
                   for name, tp, pp in (("pp=1", 1, 1), ("pp=2", 1, 2), ("tp=2", 2, 1))]
        bubbles = run_bubble(model, 2, ms, args)
    finally:
        torch.set_num_threads(old_threads)
        if tmp is not None:
            tmp.cleanup()
    print(format_tables(results, bubbles, 2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        model=args.model or "random-smollm2-shape", load_average=os.getloadavg(),
        throughput=[dict(name=r.name, tp=r.tp, pp=r.pp, seconds=r.seconds,
                         output_tokens=r.output_tokens, memory=r.memory) for r in results],
        bubble=[dict(m=m, measured=a, textbook=b) for m, a, b, _ in bubbles]), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
