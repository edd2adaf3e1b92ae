"""Batch-1 latency: ``minivllm bench latency [--dtype float32 bfloat16] [--quantization int8]``.

vLLM's ``benchmarks/benchmark_latency.py`` under vLLM's name. For each dtype
(and quantization) it runs ``--batch-size`` requests of ``--input-len`` random
prompt tokens that each generate ``--output-len`` tokens (``ignore_eos``,
greedy), stepping the engine by hand, and reports:

- **TTFT**: the time of the first engine step (prefill plus the first
  sampled token), in ms;
- **decode ms per token**: the mean time of the remaining steps (one token
  per request each), and its inverse in tokens/s;
- the end-to-end latency of the whole request.

Each figure is measured twice in one run: with the fast model runner (the
``model_runner`` component's fast twin: the C++ layer stack on a CPU, CUDA
graphs on a GPU; the default where it runs) and with the model's own forward
(``enforce_eager``), so their ratio needs no quiet machine.

**Host overhead** (``host ms``) is the decode step's wall time minus its
forward's wall time, both timed in the engine without a profiler
(``StepStats.step_seconds - forward_seconds``): scheduling, preparing the
inputs, sampling, detokenizing, the outputs. The median over the decode steps
is printed for each path; the target is at most 1 ms.

``--busy-core`` runs everything while another process keeps one core busy (a
busy loop started and stopped here): the speed a laptop's user sees.

**Outside the kernels** (``outside kern. ms``) is the finer split: *decode
step wall time minus the time the step spends inside compute kernels*. The
wall time comes from the steps run without a profiler (fast path and plain
path). The kernel time comes from
one further run under :class:`minivllm.Profiler` with ``record_ops=True``
(which runs the plain forward; the fast path calls the very same ops on the
same inputs): the summed durations of the *leaf* compute operators per decode
step, i.e. the C++ kernels (``minivllm::*``) and ATen's matmuls, embedding
lookup and element-wise ops the model runs (``KERNEL_LEAF_OPS``), not the op
ranges around them. An op range (``op.linear`` ...) also holds the Python
wrapper, its checks and the dispatch, and under the profiler all of that
runs slower, so ranges measured while profiling can add up to more than an
unprofiled step (the earlier definition went negative on the fast path).
Leaf durations hold only the kernel's own work plus the profiler's
begin/end stamps. What is left is Python, dispatch, allocation, the
scheduler, the model runner, the sampler and detokenization: everything a
step does that is not model arithmetic. The op ranges are still printed as
the per-category breakdown.

**Inside the C++ layer stack**: on a CPU the fast path's decode step is one
C++ call, which no profiler sees into. One more run turns on its own clock
(:mod:`minivllm.bench._stack_phases`) and prints each phase's ms per step (norm,
qkv, rope + cache write, attention, o, ..., lm head), its share of the call,
and for the projections the GB/s at which their weights were read.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import time
from pathlib import Path

from minivllm.bench import _stack_phases as stack_phases
from minivllm.bench._alternate import alternate, figures
from minivllm.bench._harness import busy_core, decode_after_prefill, describe_machine, machine
from minivllm.profiler import Profiler

#: The op-table categories that are model kernels (the sampler is host work here).
KERNEL_OPS = ("linear", "lm_head", "attention", "norm", "rope", "activation", "cache_write",
              "embedding")

#: ATen operators that do a model kernel's arithmetic (leaves: none calls another of
#: these). With every ``minivllm::*`` C++ op they make up the kernel time of a step.
KERNEL_LEAF_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::embedding",
                             "aten::index_select", "aten::mul", "aten::add", "aten::add_",
                             "aten::silu", "aten::rsqrt", "aten::mean", "aten::pow"})


def _is_kernel_leaf(name: str) -> bool:
    return name.startswith("minivllm::") or name in KERNEL_LEAF_OPS


@dataclasses.dataclass
class StepTimes:
    """One batch run step by step: the first step, the rest, and in between."""

    ttft_s: float  # until every request has its first token
    decode_steps_s: list[float]  # each later step
    total_s: float
    host_steps_s: list[float] = dataclasses.field(default_factory=list)  # step - forward

    @property
    def host_s(self) -> float:
        """The median decode step's host time (engine-timed: step minus forward)."""
        xs = sorted(self.host_steps_s)
        return xs[len(xs) // 2] if xs else 0.0

    @property
    def decode_s(self) -> float:
        return sum(self.decode_steps_s)


def make_llm(model: str, dtype: str, quantization: str | None = None, **kw):
    """``LLM(model, dtype=..., quantization=...)``."""
    from minivllm import LLM

    return LLM(model, dtype=dtype, quantization=quantization, **kw)


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (the lowest 100 ids, often special, skipped)."""
    rng = random.Random(seed)
    return [[rng.randint(100, vocab_size - 1) for _ in range(length)] for _ in range(n)]


def time_batch(llm, prompts: list[list[int]], max_tokens: int) -> StepTimes:
    """Submit ``prompts`` at once, each generating ``max_tokens``; time every engine step.

    The prefix cache is reset first, so repeated runs recompute their prompts.
    """
    from minivllm import SamplingParams

    engine = llm.llm_engine
    engine.scheduler.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(None, p, params) for p in prompts]
    started: set[str] = set()
    start = time.perf_counter()
    ttft, steps, host, last = None, [], [], start
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        now = time.perf_counter()
        if ttft is None:
            started.update(o.request_id for o in outputs)
            if len(started) == len(ids):
                ttft = now - start
        else:
            steps.append(now - last)
            host.append(stats.step_seconds - stats.forward_seconds)
        last = now
    return StepTimes(ttft_s=ttft if ttft is not None else last - start, decode_steps_s=steps,
                     total_s=last - start, host_steps_s=host)


def kernel_seconds_per_decode_step(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Seconds per decode step inside each kernel op range, from one profiled run.

    The profiler starts after the prefill step, so only decode steps count.
    """
    import minivllm

    trace = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minivllm_latency_{os.getpid()}.json")
    prof = _LeafProfiler(trace, print_summary=False, trace_steps=(0, 1), record_ops=True)
    n = decode_after_prefill(llm, prompts, max_tokens, prof)
    os.remove(trace)
    per = {op: prof.op_times[op] / max(n, 1) for op in KERNEL_OPS}
    per["step_profiled"] = sum(prof.stage_times[s] for s in minivllm.profiler.STAGES) / max(n, 1)
    per["kernel_leaves"] = prof.kernel_leaf_s / max(n, 1)
    return per


class _LeafProfiler(Profiler):
    """:class:`minivllm.Profiler`, also summing the durations of the kernel leaf operators."""

    def summarize(self, events):
        self.kernel_leaf_s = sum(e.duration_ns() for e in events
                                 if _is_kernel_leaf(e.name())) / 1e9  # fmt: skip
        return super().summarize(events)


def run_one(args, dtype: str, quantization: str | None) -> dict:
    """Both paths and the profile for one dtype / quantization."""
    llm = make_llm(args.model, dtype, quantization, backend=args.backend, device=args.device,
                   max_model_len=args.input_len + args.output_len + 16)
    engine = llm.llm_engine
    worker = engine.executor.worker
    prompts = random_prompts(args.batch_size, args.input_len, engine.vocab_size, args.seed)
    time_batch(llm, [p[:16] for p in prompts], 4)  # warm up: allocator, first calls
    result = dict(dtype=str(engine.dtype).replace("torch.", ""), quantization=quantization,
                  paths={})
    fast = worker.build_model_runner(enforce_eager=False)
    paths = ["fast", "plain"] if fast.fast_paths else ["plain"]
    # The C++ kernels' thread modes (docs/kernels.md, "Threads"): the first is "fast", the rest
    # "fast/<mode>", measured one after the other in this run.
    modes = args.cpu_parallel if uses_cpu_ops(engine) else [None]
    runs_of = [(p, m) for p in paths for m in (modes if p == "fast" else [None])]

    def one_run(path: str, mode: str | None) -> dict:
        worker.build_model_runner(enforce_eager=path == "plain")
        with cpu_parallel_mode(mode or modes[0]):
            r = time_batch(llm, prompts, args.output_len)
        return dict(ttft_ms=1000 * r.ttft_s, latency_s=r.total_s, host_ms=1000 * r.host_s,
                    decode_ms_per_step=1000 * r.decode_s / max(len(r.decode_steps_s), 1))

    # The paths alternate (fast, plain, fast, ...: minivllm.bench._alternate), so that a
    # slow minute of a shared machine hits both; each figure is the median of its runs.
    names = {(p, m): f"fast/{m}" if m is not None and m != modes[0] else p for p, m in runs_of}
    runs = alternate({names[k]: functools.partial(one_run, *k) for k in runs_of},
                     args.num_iters)
    for path, rows in runs.items():
        figs = figures(rows)
        result["paths"][path] = {k: f.median for k, f in figs.items()}
        result["paths"][path]["decode_spread"] = figs["decode_ms_per_step"].spread
    worker.build_model_runner(enforce_eager=False)
    if not args.no_profile:
        kernels = kernel_seconds_per_decode_step(llm, prompts, args.output_len)
        kernel_ms = 1000 * kernels["kernel_leaves"]
        result["kernel_ms_per_step"] = kernel_ms
        result["op_range_ms_per_step"] = 1000 * sum(kernels[op] for op in KERNEL_OPS)
        result["op_ms_per_step"] = {op: 1000 * kernels[op] for op in KERNEL_OPS}
        result["profiled_step_ms"] = 1000 * kernels["step_profiled"]
        for r in result["paths"].values():
            r["outside_kernels_ms"] = r["decode_ms_per_step"] - kernel_ms
        if "fast" in paths:  # the fast path's one C++ call a step, phase by phase
            stack = stack_phases.measure(llm, prompts, args.output_len)
            if stack is not None:
                result["layer_stack"] = stack
    llm.shutdown()
    return result


def uses_cpu_ops(engine) -> bool:
    """True if ``engine`` runs on a CPU where the C++ kernels (and their thread team) are."""
    from minivllm.fast import cpu_ops

    return engine.device.type == "cpu" and cpu_ops.available()


@contextlib.contextmanager
def cpu_parallel_mode(mode: str | None):
    """The C++ kernels' loops in ``mode`` ("adaptive", "team", "openmp") for the block."""
    if mode is None:
        yield
        return
    from minivllm.fast import cpu_ops

    old = cpu_ops.ops().cpu_parallel_mode(mode)
    try:
        yield
    finally:
        cpu_ops.ops().cpu_parallel_mode(old)


def format_table(results: list[dict], args) -> str:
    load = "; one core kept busy by another process" if args.busy_core else ""
    lines = [f"minivllm bench latency: {args.model}, batch {args.batch_size}, "
             f"{args.input_len} prompt + {args.output_len} output tokens, median of "
             f"{args.num_iters} alternated runs per path (decode ±spread; over 15% is noisy); "
             f"{describe_machine()}{load}",
             f"{'dtype':<10}{'quant':<7}{'path':<14}{'TTFT ms':>9}{'decode ms/tok':>15}"
             f"{'decode tok/s':>14}{'latency s':>11}{'host ms':>9}{'kernels ms':>12}"
             f"{'outside kern. ms':>18}"]
    for res in results:
        for path, r in res["paths"].items():
            kern = res.get("kernel_ms_per_step")
            outside = r.get("outside_kernels_ms")
            lines.append(
                f"{res['dtype']:<10}{res['quantization'] or '-':<7}{path:<14}{r['ttft_ms']:>9.1f}"
                f"{r['decode_ms_per_step']:>10.2f}±{r.get('decode_spread', 0):<4.0%}"
                f"{1000 * args.batch_size / r['decode_ms_per_step']:>14.1f}"
                f"{r['latency_s']:>11.2f}{r['host_ms']:>9.2f}"
                f"{'' if kern is None else f'{kern:.2f}':>12}"
                f"{'' if outside is None else f'{outside:.2f}':>18}")
        if "fast" in res["paths"] and "plain" in res["paths"]:
            f, p = res["paths"]["fast"], res["paths"]["plain"]
            lines.append(f"  fast path: decode {p['decode_ms_per_step'] / f['decode_ms_per_step']:.2f}x"
                         f" the plain path, host {p['host_ms']:.2f} -> "
                         f"{f['host_ms']:.2f} ms/step")
        for path, r in res["paths"].items():
            if path.startswith("fast/"):
                f = res["paths"]["fast"]
                lines.append(f"  threads: {args.cpu_parallel[0]} decodes "
                             f"{r['decode_ms_per_step'] / f['decode_ms_per_step']:.2f}x as fast as "
                             f"{path.split('/')[1]}")
        if "op_ms_per_step" in res:
            ops = ", ".join(f"{op} {ms:.2f}" for op, ms in res["op_ms_per_step"].items())
            lines.append(f"  kernels per decode step (ms): {ops}; a profiled plain step "
                         f"{res['profiled_step_ms']:.2f} ms")
        if "layer_stack" in res:
            lines += stack_phases.format_lines(res["layer_stack"])
    lines.append("host ms = decode step wall time - its forward's wall time, both timed in the "
                 "engine (target <= 1 ms); outside kern. ms = step wall time - time inside the "
                 "kernels (leaf operators: minivllm::* and ATen's matmuls; see --help)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   help="one or more dtypes, each measured in turn")
    p.add_argument("--quantization", nargs="+", default=None,
                   help="weight quantizations to measure too (int8, int4), passed to "
                        "LLM(quantization=...) where this minivllm has it")
    p.add_argument("--backend", default="fast", help="ref, fast, auto or an import path")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiled runs (no kernel time, and no phases of the C++ "
                        "layer stack)")
    p.add_argument("--busy-core", action="store_true",
                   help="measure while another process keeps one core busy (started and "
                        "stopped here): a laptop is never idle")
    p.add_argument("--cpu-parallel", nargs="+", default=["adaptive"],
                   choices=["adaptive", "team", "openmp"],
                   help="where the C++ kernels' loops run (docs/kernels.md, Threads): the thread "
                        "team, leaving a late helper's work to the caller alone "
                        "('adaptive', the default), the team always ('team'), or OpenMP's "
                        "at::parallel_for ('openmp'); several are measured in turn, in "
                        "one run (with --busy-core: which tolerates a busy core)")
    p.add_argument("--out", default="results/bench_latency.json")
    p.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help="compare speculative decoding with this config (vLLM's dict, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}') against "
                        "plain decoding on a grounded and a random workload instead "
                        "(minivllm/bench/_spec_latency.py)")
    p.add_argument("--spec-batch-sizes", type=int, nargs="+", default=[1, 64],
                   help="batch sizes of the --speculative-config comparison")
    p.add_argument("--spec-workloads", nargs="+", default=["grounded", "random"],
                   choices=["grounded", "random"],
                   help="workloads of the --speculative-config comparison")
    args = p.parse_args(argv)
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    if args.speculative_config is not None:
        from minivllm.bench import _spec_latency as spec_latency

        return spec_latency.run(args)
    with busy_core(args.busy_core):
        results = [run_one(args, dtype, None) for dtype in args.dtype]
        for q in args.quantization or []:
            results += [run_one(args, dtype, q) for dtype in args.dtype]
    print(format_table(results, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=args.model, batch_size=args.batch_size,
                                   busy_core=args.busy_core,
                                   input_len=args.input_len, output_len=args.output_len,
                                   machine=machine(), results=results), indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
