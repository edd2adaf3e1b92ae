"""Long-prompt prefill on a CPU: ``minivllm bench prefill [--lengths 512 2048 4096] [--e2e 4096]``.

Item 5 of issue 15 in one run. Two parts, each timing the C++ attention op's
two prefill paths side by side in the same process:

- **kernel**: one sequence of L tokens at SmolLM2-135M's attention shapes
  (9 query / 3 KV heads, head_dim 64, block_size 16, float32, blocks in random
  order), for each ``--lengths`` L: the GEMM-shaped prefill
  (``csrc/attention_tile.h``, the default), the per-query-vector row loop it
  replaced (``gemm_prefill=False``) and ``F.scaled_dot_product_attention`` on
  the same work made dense (K/V gathered outside the timing). GFLOP/s count
  ``4 H L^2 D / 2`` (two matmuls, the causal half). Medians of wall-clock
  repeats (with ``--threads 1``: the thread's CPU time).
- **end to end** (``--e2e L``): one L-token prompt of random token ids through
  ``LLM(model)`` in one engine step (``max_num_batched_tokens = L``), generating
  one token, with the fast attention (GEMM prefill) and with the row loop in the
  attention component's place (the import path ``minivllm.bench.prefill``
  provides it as ``attention``); prefill tok/s = L / TTFT. With
  ``--llamacpp-dir`` (or ``$MINIVLLM_LLAMACPP_DIR``) it also runs llama.cpp's
  ``llama-bench -p L`` on ``--gguf`` (default: the F32 file made by
  ``minivllm bench llamacpp --quantize``), same threads.

Both share the machine with whatever else runs: print ``uptime`` with it.
"""

from __future__ import annotations

import argparse
import json
import os
import types
from pathlib import Path

import torch

from minivllm.bench._harness import median_ms


def _rowloop_paged_attention(query, k_cache, v_cache, metadata, scale):
    """The fast attention with prefills sent through the row loop (the kernel before GEMM tiles)."""
    from minivllm.fast import attention as fast_attention

    if query.device.type != "cpu":
        return fast_attention.paged_attention(query, k_cache, v_cache, metadata, scale)
    return fast_attention.paged_attention_cpu(query, k_cache, v_cache, metadata, scale,
                                              gemm_prefill=False)  # fmt: skip


def _gather_kv(*args, **kwargs):
    from minivllm.ref.attention import gather_kv

    return gather_kv(*args, **kwargs)


#: The ``attention`` component of the backend ``{"attention": "minivllm.bench.prefill"}``.
attention = types.SimpleNamespace(paged_attention=_rowloop_paged_attention, gather_kv=_gather_kv)


def bench_kernel(length: int, repeats: int) -> dict:
    """Row loop vs GEMM tiles vs SDPA for one ``length``-token prefill at SmolLM2's shapes."""
    import torch.nn.functional as F

    from minivllm.bench.kernels import _dense, _paged_batch
    from minivllm.fast.attention import paged_attention_cpu

    heads, kv_heads, d, bs = 9, 3, 64, 16
    q, kc, vc, md = _paged_batch([length], [length], heads, kv_heads, d, bs, torch.float32, "cpu")
    scale = d**-0.5
    qd = q.view(1, length, heads, d).transpose(1, 2)
    kd = _dense(kc, md.block_tables, length).transpose(1, 2).repeat_interleave(3, 1)
    vd = _dense(vc, md.block_tables, length).transpose(1, 2).repeat_interleave(3, 1)

    def sdpa():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

    def run(gemm):
        return paged_attention_cpu(q, kc, vc, md, scale, gemm_prefill=gemm)

    expect = sdpa().transpose(1, 2).reshape(q.shape)
    err = max((run(g) - expect).abs().max().item() for g in (True, False))
    t_gemm = median_ms(lambda: run(True), repeats)
    t_rows = median_ms(lambda: run(False), repeats)
    t_sdpa = median_ms(sdpa, repeats)
    gflop = 4 * heads * length * length * d / 2 / 1e9
    return dict(length=length, gemm_ms=t_gemm, rows_ms=t_rows, sdpa_ms=t_sdpa,
                rows_over_gemm=t_rows / t_gemm, sdpa_over_gemm=t_sdpa / t_gemm,
                gemm_GFLOPs=gflop / (t_gemm * 1e-3), rows_GFLOPs=gflop / (t_rows * 1e-3),
                sdpa_GFLOPs=gflop / (t_sdpa * 1e-3), max_abs_err=err)  # fmt: skip


def bench_e2e(model: str, length: int, dtype: str, repeats: int) -> dict:
    """Prefill tok/s of one ``length``-token prompt, GEMM prefill vs row loop, one process."""
    from minivllm.bench.latency import make_llm, random_prompts, time_batch

    out = {}
    for name, backend in (("gemm", None), ("rows", {"attention": "minivllm.bench.prefill"})):
        llm = make_llm(model, dtype, backend=backend, max_num_seqs=1,
                       max_num_batched_tokens=length, max_model_len=length + 16)  # fmt: skip
        prompt = random_prompts(1, length, llm.llm_engine.vocab_size, seed=1)
        time_batch(llm, random_prompts(1, 64, llm.llm_engine.vocab_size), 1)  # warm-up
        ttft = min(time_batch(llm, prompt, 1).ttft_s for _ in range(repeats))
        out[f"{name}_tok_s"] = length / ttft
        out[f"{name}_ttft_s"] = ttft
        print(f"  minivllm {dtype} {name}: {length} tokens in {ttft:.2f} s "
              f"= {length / ttft:.0f} tok/s", flush=True)  # fmt: skip
        llm.shutdown()
    out["gemm_over_rows"] = out["gemm_tok_s"] / out["rows_tok_s"]
    return out


def bench_llamacpp(length: int, gguf: str | None, build_dir: str | None) -> dict | None:
    """``llama-bench -p length`` tok/s on ``gguf``, or None (with a note) without the tools."""
    from minivllm.bench import llamacpp

    try:
        tool_dir = build_dir or os.environ.get("MINIVLLM_LLAMACPP_DIR")
        if gguf is None:
            gguf = str(Path(tool_dir or ".").expanduser().parent / "gguf" /
                       "SmolLM2-135M-Instruct.F32.gguf")  # fmt: skip
        res = llamacpp.llama_bench(Path(gguf), length, 0, torch.get_num_threads(),
                                   build_dir=tool_dir)  # fmt: skip
    except (SystemExit, RuntimeError, FileNotFoundError) as e:
        print(f"  llama.cpp skipped: {e}", flush=True)
        return None
    return dict(gguf=gguf, pp_tok_s=res.get(f"pp{length}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm bench prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 4096],
                   help="prompt lengths of the kernel part (none: skip it)")
    p.add_argument("--e2e", type=int, default=0, metavar="L",
                   help="also time one L-token prompt end to end (0: skip)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch / C++ op threads")
    p.add_argument("--llamacpp-dir", default=None,
                   help="llama.cpp build with llama-bench: also run its pp L (with --e2e)")
    p.add_argument("--gguf", default=None, help="GGUF for llama-bench (default: DIR/../gguf F32)")
    p.add_argument("--out", default="results/bench_prefill.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    result = dict(threads=torch.get_num_threads(), load_avg=load, kernel=[], e2e=None)
    print(f"minivllm bench prefill: {torch.get_num_threads()} threads, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)  # fmt: skip
    if args.lengths:
        print(f"{'L':>6}{'rows ms':>10}{'GEMM ms':>10}{'SDPA ms':>10}{'rows/GEMM':>11}"
              f"{'SDPA/GEMM':>11}{'GEMM GFLOP/s':>14}  max err")  # fmt: skip
    for length in args.lengths:
        r = bench_kernel(length, args.repeats)
        result["kernel"].append(r)
        print(f"{length:>6}{r['rows_ms']:>10.1f}{r['gemm_ms']:>10.1f}{r['sdpa_ms']:>10.1f}"
              f"{r['rows_over_gemm']:>10.2f}x{r['sdpa_over_gemm']:>10.2f}x"
              f"{r['gemm_GFLOPs']:>14.1f}  {r['max_abs_err']:.1e}", flush=True)  # fmt: skip
    if args.e2e:
        result["e2e"] = bench_e2e(args.model, args.e2e, args.dtype, args.repeats)
        if args.llamacpp_dir or os.environ.get("MINIVLLM_LLAMACPP_DIR") or args.gguf:
            result["llamacpp"] = bench_llamacpp(args.e2e, args.gguf, args.llamacpp_dir)
            if result["llamacpp"] and result["llamacpp"]["pp_tok_s"]:
                pp = result["llamacpp"]["pp_tok_s"]
                print(f"  llama.cpp pp{args.e2e}: {pp:.0f} tok/s; minivllm GEMM / llama.cpp "
                      f"{result['e2e']['gemm_tok_s'] / pp:.2f}x", flush=True)  # fmt: skip
    result["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"load average at the end {result['load_avg_end'][0]:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
