"""The quantized decode GEMVs on a CPU, against the machine's read bandwidth.

Called by ``minivllm bench kernels`` (:func:`bench_quant_gemv`). For each of
SmolLM2-135M's projection shapes (qkv / gate_up / down / LM head: ``N x K`` =
1728 x 576, 3072 x 576, 576 x 1536, 49152 x 576) and each format (int8 per
channel, int4 in groups of 32), one token row (M = 1) is multiplied by the
C++ op (``int8_linear`` / ``int4_linear``, see ``minivllm/fast/csrc/quant.cpp``).

A decode step reads each weight once, from memory, not from a cache: so the
op cycles through enough copies of the weight to fill :data:`COLD_BYTES`
(more than the L3), and the time per call is one pass over all copies
divided by their number. GB/s counts the quantized bytes read (integers +
scales + minimums) per call; the fraction is of the read bandwidth measured
in the same run (``bench._harness.read_bandwidth``). The ref column is the ref
twin's ``quantized_linear`` on the same (warm) weight.

:func:`bench_w8a8` puts W8A8 beside W8A16 on the same weights: the integer
dot-product kernels (``w8a8_linear`` / ``w4a8_linear``, with the activations'
quantization, ``quantize_activations_int8``, counted in) against the
float-activation kernels, at M = 1 (a batch-1 decode step: reading the weight
is the cost) and M = 64 (a batch-64 decode step: the arithmetic is). The two
are timed in turns and each keeps its fastest pass, so a burst of load on a
shared machine falls on both alike.
"""

from __future__ import annotations

import math

import torch

#: Bytes of weight copies cycled through, so every call reads its weight from memory.
COLD_BYTES = 256 * 2**20
#: ``(N, K)`` of SmolLM2-135M's linear layers: fused QKV, fused gate/up, down, LM head.
SHAPES = ((1728, 576), (3072, 576), (576, 1536), (49152, 576))


def bench_quant_gemv(read_bw: float, shapes=SHAPES, methods=("int8", "int4"),
                     m: int = 1, cold_bytes: int = COLD_BYTES) -> list[dict]:
    """One row per (method, shape): the C++ quantized GEMV's ms, GB/s and read fraction."""
    from minivllm.bench._harness import max_abs_err, median_ms, speedup_row
    from minivllm.fast import cpu_ops
    from minivllm.ref import quantization as ref

    ops = cpu_ops.ops()
    rows = []
    for method in methods:
        for n, k in shapes:
            w = torch.randn(n, k) * 0.02
            qw = ref.quantize(w, method)
            del w
            copies = max(1, math.ceil(cold_bytes / qw.nbytes))
            weights = [ref.QuantizedWeight(qw.method, qw.qweight.clone(), qw.scales.clone(),
                                           None if qw.mins is None else qw.mins.clone(),
                                           qw.group_size) for _ in range(copies)]  # fmt: skip
            x = torch.randn(m, k)
            out = torch.empty(m, n)

            def call(weight, out=out, x=x, method=method):
                if method == "int8":
                    ops.int8_linear(out, x, weight.qweight, weight.scales)
                else:
                    ops.int4_linear(out, x, weight.qweight, weight.scales, weight.mins)
                return out

            def cycle(weights=weights, call=call):
                for weight in weights:
                    call(weight)

            err = max_abs_err(call(qw).clone(), ref.quantized_linear(x, qw))
            t_fast = median_ms(cycle) / copies
            t_ref = median_ms(lambda x=x, qw=qw: ref.quantized_linear(x, qw))
            nbytes = qw.nbytes + 4 * (x.numel() + out.numel())  # weight read once, x, y
            gbps = nbytes / (t_fast * 1e-3)
            note = (f"{100 * gbps / read_bw:.0f}% of read bandwidth; "
                    f"{nbytes / (n * k):.3f} B/weight; {copies} cold copies")  # fmt: skip
            rows.append(speedup_row(f"{method} GEMV {n}x{k}", t_ref, t_fast, err, nbytes,
                             dict(shape=f"M{m} K{k} N{n} {method}", read_GBps=read_bw,
                                  read_fraction=gbps / read_bw, note=note)))
            del weights
    return rows


def _fastest_in_turns(fns: list, rounds: int = 7) -> list[float]:
    """Milliseconds of each ``fn()``: one run of each in turn, ``rounds`` times, the fastest."""
    import time

    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()  # warm-up
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best


def bench_w8a8(shapes=SHAPES, methods=("int8", "int4"), ms=(1, 64),
               cold_bytes: int = COLD_BYTES, isa: str = "auto") -> list[dict]:
    """One row per (method, shape, M): the W8A16 kernel (ref column) against W8A8 (fast)."""
    from minivllm.bench._harness import max_abs_err, speedup_row
    from minivllm.fast import cpu_ops
    from minivllm.ref import quantization as ref

    ops = cpu_ops.ops()
    rows = []
    for method in methods:
        for n, k in shapes:
            w_float = torch.randn(n, k) * 0.02
            qw = ref.quantize(w_float, method)
            copies = max(1, math.ceil(cold_bytes / qw.nbytes))
            weights = [[t.clone() for t in (qw.qweight, qw.scales, qw.mins) if t is not None]
                       for _ in range(copies)]  # fmt: skip
            for m in ms:
                x = torch.randn(m, k)
                out = torch.empty(m, n)
                groups = k // 32
                q, xs, xsum = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, groups),
                               torch.empty(m, groups))

                def w8a16(w, x=x, out=out, method=method):
                    if method == "int8":
                        ops.int8_linear(out, x, *w)
                    else:
                        ops.int4_linear(out, x, *w)
                    return out

                def w8a8(w, x=x, out=out, q=q, xs=xs, xsum=xsum, method=method):
                    ops.quantize_activations_int8(q, xs, xsum, x, isa)
                    if method == "int8":
                        ops.w8a8_linear(out, q, xs, *w, isa)
                    else:
                        ops.w4a8_linear(out, q, xs, xsum, *w, isa)
                    return out

                err = max_abs_err(w8a16(weights[0]).clone(), w8a8(weights[0]))
                fns = [
                    lambda f=w8a16, ws=weights: [f(w) for w in ws],
                    lambda f=w8a8, ws=weights: [f(w) for w in ws],
                    lambda x=x, q=q, xs=xs, xsum=xsum, ws=weights: [
                        ops.quantize_activations_int8(q, xs, xsum, x, isa) for _ in ws],
                ]  # fmt: skip
                if m > 1:  # the GEMM floor: torch's float32 GEMM at this shape (warm weight)
                    fns.append(lambda x=x, w=w_float, ws=weights: [torch.mm(x, w.T) for _ in ws])
                t16, t8, tq, *tf = (t / copies for t in _fastest_in_turns(fns))
                scheme = "W8A8" if method == "int8" else "W4A8"
                macs = m * n * k
                note = (f"ref column: W{scheme[1]}A16; {scheme} "
                        f"{2 * macs / (t8 * 1e-3) / 1e9:.1f} GFLOP/s, W{scheme[1]}A16 "
                        f"{2 * macs / (t16 * 1e-3) / 1e9:.1f}; quantizing x {tq * 1e3:.0f} us; "
                        + (f"{tf[0] / t8:.0%} of the floor, torch's float32 GEMM "
                           f"({2 * macs / (tf[0] * 1e-3) / 1e9:.1f} GFLOP/s); " if tf else "")
                        + f"{copies} cold copies")  # fmt: skip
                rows.append(speedup_row(f"{scheme} M{m} {n}x{k}", t16, t8, err, None,
                                        dict(shape=f"M{m} K{k} N{n} {method}", note=note)))
            del weights
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m minivllm.bench quant_kernels [--threads T] [--m M] [--w8a8]``: these rows."""
    import argparse

    from minivllm.bench._harness import read_bandwidth

    p = argparse.ArgumentParser(prog="python -m minivllm.bench quant_kernels",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--m", type=int, default=1, help="token rows (default 1)")
    p.add_argument("--w8a8", action="store_true",
                   help="W8A8 against W8A16 at M = 1 and 64 instead (bench_w8a8)")
    p.add_argument("--isa", default="auto", help="the W8A8 kernels' instruction set")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minivllm.bench._harness import describe_machine

    print(f"{describe_machine()}, {torch.get_num_threads()} threads")
    if args.w8a8:
        from minivllm.fast import cpu_ops

        print(f"W8A8 instruction sets here: {list(cpu_ops.ops().w8a8_isas())}; using {args.isa}")
        for r in bench_w8a8(isa=args.isa):
            print(f"{r['kernel']:<24}{r['ref_ms']:>9.3f} ms A16{r['fast_ms']:>9.3f} ms A8  "
                  f"x{r['speedup']:.2f}  {r['note']}")
        return 0
    bw = read_bandwidth("cpu", 2**28)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s")
    for r in bench_quant_gemv(bw, m=args.m):
        print(f"{r['kernel']:<22}{r['shape']:<22}{r['ref_ms']:>9.3f} ms ref{r['fast_ms']:>9.4f} ms"
              f"{r['fast_GBps'] / 1e9:>7.1f} GB/s  {r['note']}; max err {r['max_abs_err']:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
