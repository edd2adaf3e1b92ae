"""Kernel benchmark: ``python -m minivllm.bench kernels [--out results/bench_kernels.json]``.

Times the ref twin and the fast twin of every kernel component, checks that
both give the same values, and reports speed-ups and, for the memory-bound
kernels, GB/s against a copy bandwidth measured in the same run.

On a CPU (no CUDA device) the fast twin is the C++ ops
(``minivllm/fast/csrc``), timed as medians of wall-clock repeats, at
SmolLM2-135M's shapes in float32 (the dtype the CPU engine runs): decode
attention at batch 64 x context 1024 (9 query / 3 KV heads, head_dim 64,
block_size 16), prefill attention (4 x 256 tokens, against SDPA on the same
dense work), the norms, SiLU-and-mul, RoPE and the cache write at 2048 tokens.
The copy bandwidth is a 256 MiB ``copy_`` (bytes read + written), so GB/s
fractions say how close each kernel gets to the memory system's limit.
The decode-shaped linear (the fast ``linear`` twin's C++ GEMV on SmolLM2's
49152 x 576 LM head, 56 MB in bf16, 113 MB in float32: larger than the caches;
one token row in bf16 and float32, and 4 rows in float32) is timed against
``F.linear`` (oneDNN/MKL) in the ref's column, and its GB/s (weight
bytes / time) against the *read* bandwidth measured in the same run (a
``sum`` over 256 MiB of float32, bytes read / time), because a GEMV only reads.
The quantized GEMVs (int8, int4; M = 1 on SmolLM2's four projection shapes,
cold weights) are :mod:`minivllm.bench.quant_kernels`'s rows.

On a CUDA device it times the Triton twin on production-like shapes
(``triton.testing.do_bench`` medians) and reports:

- decode attention (flash-decoding), batch 64 x context 4096, 32 query / 8 KV
  heads, head_dim 128, bf16, block_size 16: GB/s, where bytes = the K and V
  context read + queries read + outputs written, and the fraction of the
  memory bandwidth measured in the same run by a 1 GiB device-to-device copy
  (``2 * bytes / time``: read + write);
- prefill attention, 8 sequences x 1024 tokens, same heads: time against
  ``F.scaled_dot_product_attention(..., is_causal=True)`` on the same dense
  work (the ratio ``t_sdpa / t_fast``; 1.0 = as fast as PyTorch's
  FlashAttention), and TFLOP/s counting ``2 * 2 * B * H * L^2 * D / 2``
  (two matmuls, causal half);
- fused add + RMSNorm, RMSNorm, SiLU-and-mul, RoPE and the cache write:
  speed-up over the ref and GB/s from the minimum bytes each must move.

``--tiny`` runs every case on tiny shapes through the Triton kernels in
Triton's interpreter, to check the benchmark itself (labelled "interpreter,
correctness only": its times mean nothing). Prints a table, writes JSON and a
PNG plot next to it.

``--backend PKG`` times an import path (a course student's package) in the
fast twin's place, against the ref: the course leaderboard.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path
from types import MappingProxyType

import torch

from minivllm.bench._harness import (
    copy_bandwidth,
    dtype_name,
    max_abs_err,
    median_ms,
    read_bandwidth,
    speedup_row,
)

#: Benchmark shapes; ``tiny`` is for checking the benchmark code in the interpreter.
SHAPES = MappingProxyType({
    "full": dict(decode=(64, 4096, 32, 8, 128, 16), prefill=(8, 1024, 32, 8, 128, 16),
                 norm=(4096, 4096), silu=(4096, 14336), rope=(4096, 32, 8, 128, 8192),
                 cache=(4096, 8, 128, 16), copy_bytes=2**30),
    "tiny": dict(decode=(2, 40, 4, 2, 16, 16), prefill=(2, 20, 4, 2, 16, 16),
                 norm=(3, 64), silu=(3, 40), rope=(3, 4, 2, 16, 64),
                 cache=(5, 2, 16, 4), copy_bytes=2**20),
    "cpu": dict(decode=(64, 1024, 9, 3, 64, 16), prefill=(4, 256, 9, 3, 64, 16),
                norm=(2048, 576), silu=(2048, 1536), rope=(2048, 9, 3, 64, 8192),
                cache=(2048, 3, 64, 16), copy_bytes=2**28, dtype=torch.float32,
                gemv=(1, 576, 49152)),
})  # fmt: skip


# ----------------------------------------------------------------------------- helpers
def _paged_batch(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, device):
    """A paged cache holding ``seq_lens`` tokens per sequence in random blocks, + metadata."""
    from minivllm.metadata import AttentionMetadata

    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[first : first + n]
        first += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=device)
    md = AttentionMetadata.build(
        query_lens, seq_lens, tables, torch.full((num_tokens,), -1, dtype=torch.int64), device
    )
    return query, k_cache, v_cache, md


def bench_decode(ref, fast, bw: float, device: str, shapes: dict) -> dict:
    dtype = shapes.get("dtype", torch.bfloat16)
    size = dtype.itemsize  # bytes per element
    batch, ctx, heads, kv_heads, d, bs = shapes["decode"]
    q, kc, vc, md = _paged_batch([ctx] * batch, [1] * batch, heads, kv_heads, d, bs,
                                 dtype, device)  # fmt: skip
    scale = d**-0.5
    out_fast = fast.paged_attention(q, kc, vc, md, scale)
    err = max_abs_err(out_fast, ref.paged_attention(q, kc, vc, md, scale))
    t_fast = median_ms(lambda: fast.paged_attention(q, kc, vc, md, scale))
    t_ref = median_ms(lambda: ref.paged_attention(q, kc, vc, md, scale))
    nbytes = (2 * batch * ctx * kv_heads * d + 2 * q.numel()) * size  # K+V read, q read, out write
    return speedup_row("decode attention", t_ref, t_fast, err, nbytes,
                dict(shape=f"B{batch} ctx{ctx} H{heads}/{kv_heads} d{d} {dtype_name(dtype)} bs{bs}"),
                bw=bw)  # fmt: skip


def _dense(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of each sequence, contiguous: (S, length, H_kv, D)."""
    blocks = cache[tables.long()]  # (S, max_blocks, block_size, H_kv, D)
    return blocks.flatten(1, 2)[:, :length]


def bench_prefill(ref, fast, device: str, shapes: dict) -> dict:
    import torch.nn.functional as F

    dtype = shapes.get("dtype", torch.bfloat16)

    batch, seq, heads, kv_heads, d, bs = shapes["prefill"]
    q, kc, vc, md = _paged_batch([seq] * batch, [seq] * batch, heads, kv_heads, d, bs,
                                 dtype, device)  # fmt: skip
    scale = d**-0.5
    # The same work, dense, for SDPA: (B, H, L, D), K/V gathered once outside the timing.
    qd = q.view(batch, seq, heads, d).transpose(1, 2)
    kd = _dense(kc, md.block_tables, seq).transpose(1, 2)  # (B, H_kv, L, D)
    vd = _dense(vc, md.block_tables, seq).transpose(1, 2)
    group = heads // kv_heads
    try:
        def sdpa():
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                  enable_gqa=True)  # fmt: skip
        sdpa()
    except TypeError:  # older torch: no enable_gqa; expand the KV heads instead
        kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)

        def sdpa():
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

    out_fast = fast.paged_attention(q, kc, vc, md, scale)
    err = max_abs_err(out_fast.view(batch, seq, heads, d).transpose(1, 2), sdpa())
    t_fast = median_ms(lambda: fast.paged_attention(q, kc, vc, md, scale))
    t_ref = median_ms(lambda: ref.paged_attention(q, kc, vc, md, scale))
    t_sdpa = median_ms(sdpa)
    flops = 4 * batch * heads * seq * seq * d / 2
    return speedup_row("prefill attention", t_ref, t_fast, err, None,
                dict(shape=f"B{batch} L{seq} H{heads}/{kv_heads} d{d} {dtype_name(dtype)} bs{bs}",
                     sdpa_ms=t_sdpa, sdpa_over_fast=t_sdpa / t_fast,
                     fast_TFLOPs=flops / (t_fast * 1e-3) / 1e12,
                     sdpa_TFLOPs=flops / (t_sdpa * 1e-3) / 1e12))  # fmt: skip


def bench_norms(ref, fast, device: str, shapes: dict) -> list[dict]:
    dtype = shapes.get("dtype", torch.bfloat16)
    size = dtype.itemsize  # bytes per element
    tokens, hidden = shapes["norm"]
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    r = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dtype, device=device)
    n = x.numel() * size
    o_ref = ref.fused_add_rms_norm(x, r, w, 1e-6)
    o_fast = fast.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    err = max(max_abs_err(o_ref[0], o_fast[0]), max_abs_err(o_ref[1], o_fast[1]))
    # The fast twin updates x/residual in place; re-running it on the same buffers is fine
    # for timing (the residual just keeps growing, which costs the same).
    xf, rf = x.clone(), r.clone()
    fused = speedup_row("fused add+RMSNorm", median_ms(lambda: ref.fused_add_rms_norm(x, r, w, 1e-6)),
                 median_ms(lambda: fast.fused_add_rms_norm(xf, rf, w, 1e-6)), err, 4 * n,
                 dict(shape=f"T{tokens} hidden{hidden} {dtype_name(dtype)}"))  # fmt: skip
    err = max_abs_err(ref.rms_norm(x, w, 1e-6), fast.rms_norm(x, w, 1e-6))
    plain = speedup_row("RMSNorm", median_ms(lambda: ref.rms_norm(x, w, 1e-6)),
                 median_ms(lambda: fast.rms_norm(x, w, 1e-6)), err, 2 * n,
                 dict(shape=f"T{tokens} hidden{hidden} {dtype_name(dtype)}"))  # fmt: skip
    return [fused, plain]


def bench_silu(ref, fast, device: str, shapes: dict) -> dict:
    dtype = shapes.get("dtype", torch.bfloat16)
    size = dtype.itemsize  # bytes per element
    tokens, inter = shapes["silu"]
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    err = max_abs_err(ref.silu_and_mul(x), fast.silu_and_mul(x))
    return speedup_row("SiLU-and-mul", median_ms(lambda: ref.silu_and_mul(x)),
                median_ms(lambda: fast.silu_and_mul(x)), err, 3 * tokens * inter * size,
                dict(shape=f"T{tokens} I{inter} {dtype_name(dtype)}"))  # fmt: skip


def bench_rope(ref, fast, device: str, shapes: dict) -> dict:
    dtype = shapes.get("dtype", torch.bfloat16)
    size = dtype.itemsize  # bytes per element
    tokens, heads, kv_heads, d, max_pos = shapes["rope"]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d)
    freqs = torch.outer(torch.arange(max_pos, device=device).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos = torch.randint(0, max_pos, (tokens,), device=device)
    q = torch.randn(tokens, heads, d, dtype=dtype, device=device)
    k = torch.randn(tokens, kv_heads, d, dtype=dtype, device=device)
    rq, rk = ref.apply_rotary_emb(pos, q, k, cache)
    fq, fk = fast.apply_rotary_emb(pos, q.clone(), k.clone(), cache)
    err = max(max_abs_err(rq, fq), max_abs_err(rk, fk))
    qf, kf = q.clone(), k.clone()  # rotated in place again and again: same cost
    nbytes = 2 * tokens * (heads + kv_heads) * d * size + tokens * d * 4
    return speedup_row("RoPE (neox)", median_ms(lambda: ref.apply_rotary_emb(pos, q, k, cache)),
                median_ms(lambda: fast.apply_rotary_emb(pos, qf, kf, cache)), err, nbytes,
                dict(shape=f"T{tokens} H{heads}/{kv_heads} d{d} {dtype_name(dtype)}"))  # fmt: skip


def bench_cache_write(ref, fast, device: str, shapes: dict) -> dict:
    dtype = shapes.get("dtype", torch.bfloat16)
    size = dtype.itemsize  # bytes per element
    tokens, kv_heads, d, bs = shapes["cache"]
    num_blocks = 2 * tokens // bs
    k = torch.randn(tokens, kv_heads, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * bs, device=device)[:tokens]
    slots[::17] = -1  # some padding rows
    caches = [torch.zeros(num_blocks, bs, kv_heads, d, dtype=dtype, device=device)
              for _ in range(4)]  # fmt: skip
    ref.reshape_and_cache(k, v, caches[0], caches[1], slots)
    fast.reshape_and_cache(k, v, caches[2], caches[3], slots)
    err = max(max_abs_err(caches[0], caches[2]), max_abs_err(caches[1], caches[3]))
    nbytes = 4 * tokens * kv_heads * d * size
    return speedup_row("reshape_and_cache",
                median_ms(lambda: ref.reshape_and_cache(k, v, *caches[:2], slots)),
                median_ms(lambda: fast.reshape_and_cache(k, v, *caches[2:], slots)), err, nbytes,
                dict(shape=f"T{tokens} H_kv{kv_heads} d{d} {dtype_name(dtype)} bs{bs}"))  # fmt: skip


def bench_gemv(read_bw: float, shapes: dict) -> list[dict]:
    """The decode-shaped linear on a CPU: the C++ GEMV against F.linear (oneDNN/MKL).

    Rows: bf16 weights at M = 1, float32 weights at M = 1 and at M = 4 (a
    speculative-decoding verification of 3 drafted tokens).
    """
    import torch.nn.functional as F

    from minivllm.fast import cpu_ops

    m, k, n = shapes["gemv"]
    ops = cpu_ops.ops()
    rows = []
    for dtype, rows_m in ((torch.bfloat16, m), (torch.float32, m), (torch.float32, 4 * m)):
        w = torch.randn(n, k).to(dtype)
        x = torch.randn(rows_m, k).to(dtype)
        out = torch.empty(rows_m, n, dtype=dtype)

        def gemv(out=out, x=x, w=w):
            ops.linear_small_m(out, x, w, None, False)
            return out

        err = max_abs_err(gemv().clone(), F.linear(x, w))
        t_fast = median_ms(gemv)
        t_ref = median_ms(lambda x=x, w=w: F.linear(x, w))
        size = w.element_size()
        nbytes = w.numel() * size + (x.numel() + rows_m * n) * size  # w read once, x, y
        rows.append(speedup_row(f"GEMV (linear, M={rows_m})", t_ref, t_fast, err, nbytes,
                         dict(shape=f"M{rows_m} K{k} N{n} {dtype_name(dtype)}",
                              oneDNN_GBps=nbytes / (t_ref * 1e-3), read_GBps=read_bw,
                              read_fraction=nbytes / (t_fast * 1e-3) / read_bw,
                              avx512_bf16=dtype == torch.bfloat16
                              and bool(ops.gemv_has_avx512_bf16()))))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- report
def run_kernels(device: str, shapes: dict, fast_path: str = "minivllm.fast",
                package: str | None = None) -> dict:
    """Every case on ``device`` with the kernels of ``fast_path``, or of ``package``.

    ``minivllm.fast`` picks by device: Triton on CUDA, the C++ ops on a CPU;
    ``--tiny`` passes ``minivllm.fast.triton`` (the interpreter on a CPU).
    ``package`` (an import path, e.g. a course student's package) takes the
    fast twin's place: the leaderboard times it against the ref.
    """
    ref = {n: importlib.import_module(f"minivllm.ref.{n}") for n in
           ("attention", "layernorm", "activation", "rotary", "cache_write")}  # fmt: skip
    if package:
        from minivllm import backend

        fast = {n: backend.get(n, package) for n in ref}
    else:
        pkg = importlib.import_module(fast_path)
        fast = {n: getattr(pkg, n, None) or importlib.import_module(f"{fast_path}.{n}")
                for n in ref}
    bw = copy_bandwidth(device, shapes["copy_bytes"])
    read_bw = read_bandwidth(device, shapes["copy_bytes"]) if "gemv" in shapes else None
    rows = []
    cases = [
        ("decode", lambda: bench_decode(ref["attention"], fast["attention"], bw, device, shapes)),
        ("prefill", lambda: bench_prefill(ref["attention"], fast["attention"], device, shapes)),
        ("norms", lambda: bench_norms(ref["layernorm"], fast["layernorm"], device, shapes)),
        ("silu", lambda: bench_silu(ref["activation"], fast["activation"], device, shapes)),
        ("rope", lambda: bench_rope(ref["rotary"], fast["rotary"], device, shapes)),
        ("cache", lambda: bench_cache_write(ref["cache_write"], fast["cache_write"], device,
                                            shapes)),
    ]  # fmt: skip
    if "gemv" in shapes and not package:  # the CPU's decode-shaped linear
        cases.append(("gemv", lambda: bench_gemv(read_bw, shapes)))
        from minivllm.bench.quant_kernels import bench_quant_gemv, bench_w8a8

        cases.append(("quant_gemv", lambda: bench_quant_gemv(read_bw)))
        cases.append(("w8a8", lambda: bench_w8a8()))
    errors = {}
    for name, case in cases:
        try:
            r = case()
            rows.extend(r if isinstance(r, list) else [r])
        except Exception as e:  # one failing case must not hide the others
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"[bench kernels] {name} failed: {errors[name]}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    for r in rows:  # every memory-bound kernel against the same copy
        if "fast_GBps" in r and "read_fraction" not in r:
            r["bandwidth_fraction"] = r["fast_GBps"] / bw
    if device == "cuda":
        name, label = torch.cuda.get_device_name(), "Triton"
    elif fast_path.endswith("triton"):
        name, label = "cpu (interpreter, correctness only)", "Triton"
    else:
        threads = torch.get_num_threads()
        name = "cpu, 1 thread (CPU time)" if threads == 1 else f"cpu x{threads} threads"
        label = "C++"
    if package:
        label = package[:10]
    return dict(cuda=device == "cuda", device=name, fast_label=label, copy_GBps=bw / 1e9,
                read_GBps=None if read_bw is None else read_bw / 1e9, rows=rows, errors=errors, candidate=package or "fast")


def print_table(result: dict) -> None:
    if not result["rows"]:
        return
    label = result.get("fast_label", "fast")
    read = result.get("read_GBps")
    print(f"\nminivllm bench kernels on {result['device']}; measured copy bandwidth "
          f"{result['copy_GBps']:.1f} GB/s" + (f", read bandwidth {read:.1f} GB/s" if read else ""))
    print(f"{'kernel':<20}{'ref ms':>9}{label + ' ms':>14}{'speed-up':>10}{label + ' GB/s':>16}"
          f"  notes")  # fmt: skip
    for r in result["rows"]:
        notes = []
        if "note" in r:
            notes.append(r["note"])
        elif "read_fraction" in r:
            notes.append(f"{100 * r['read_fraction']:.0f}% of read bandwidth; F.linear "
                         f"{r['oneDNN_GBps'] / 1e9:.1f} GB/s; "
                         f"{'AVX-512 BF16' if r['avx512_bf16'] else 'FMA path'}")
        elif "bandwidth_fraction" in r:
            notes.append(f"{100 * r['bandwidth_fraction']:.0f}% of copy bandwidth")
        if "sdpa_over_fast" in r:
            notes.append(f"SDPA/{label} time {r['sdpa_over_fast']:.2f} "
                         f"({r['fast_TFLOPs']:.3g} vs {r['sdpa_TFLOPs']:.3g} TFLOP/s)")  # fmt: skip
        notes.append(f"max err {r['max_abs_err']:.2g}")
        gb = f"{r['fast_GBps'] / 1e9:.1f}" if "fast_GBps" in r else "-"
        print(f"{r['kernel']:<20}{r['ref_ms']:>9.3f}{r['fast_ms']:>14.3f}{r['speedup']:>9.1f}x"
              f"{gb:>16}  {'; '.join(notes)}")  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["rows"]
    if not rows:
        for ax in (ax1, ax2):
            ax.text(0.5, 0.5, "no kernels timed", ha="center", va="center")
            ax.set_axis_off()
    else:
        names = [r["kernel"] for r in rows]
        ax1.barh(names, [r["speedup"] for r in rows], color="tab:green")
        ax1.axvline(1.0, color="k", lw=0.8)
        ax1.set_xscale("log")
        ax1.set_xlabel(f"speed-up of {result.get('fast_label', 'fast')} over ref (log)")
        ax1.invert_yaxis()
        bw_rows = [r for r in rows if "fast_GBps" in r]
        ax2.barh([r["kernel"] for r in bw_rows], [r["fast_GBps"] / 1e9 for r in bw_rows])
        ax2.axvline(result["copy_GBps"], color="r", ls="--", label="measured copy bandwidth")
        ax2.set_xlabel(f"{result.get('fast_label', 'fast')} kernel GB/s (minimum bytes / time)")
        ax2.invert_yaxis()
        ax2.legend(loc="lower right")
    fig.suptitle(f"minivllm kernels on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="results/bench_kernels.json", help="JSON path (PNG beside it)")
    p.add_argument("--tiny", action="store_true",
                   help="without CUDA: run every case on tiny shapes through the Triton kernels "
                   "in Triton's interpreter (checks the benchmark code; the times mean nothing)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and the C++ ops (default: torch's); 1 times "
                   "the thread's CPU time, steady on a busy machine")  # fmt: skip
    p.add_argument("--backend", default=None, metavar="PKG",
                   help="time this import path (e.g. a course student package) in the fast "
                   "twin's place: the leaderboard")  # fmt: skip
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.cuda.is_available():
        result = run_kernels("cuda", SHAPES["full"], package=args.backend)
    elif args.tiny:
        import os

        if "triton" in __import__("sys").modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--tiny needs TRITON_INTERPRET=1 set before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        result = run_kernels("cpu", SHAPES["tiny"], "minivllm.fast.triton", args.backend)
    else:
        from minivllm.fast import cpu_ops

        if not args.backend and not cpu_ops.available():
            raise SystemExit(f"the C++ CPU kernels are not available "
                             f"({cpu_ops.unavailable_reason()}): nothing to time")  # fmt: skip
        result = run_kernels("cpu", SHAPES["cpu"], package=args.backend)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
