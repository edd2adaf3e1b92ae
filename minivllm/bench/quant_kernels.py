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
in the same run (``bench.harness.read_bandwidth``). The ref column is the ref
twin's ``quantized_linear`` on the same (warm) weight.
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
    from minivllm.bench.harness import max_abs_err, median_ms, speedup_row
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


def main(argv: list[str] | None = None) -> int:
    """``python -m minivllm.bench quant_kernels [--threads T] [--m M]``: only these rows."""
    import argparse

    from minivllm.bench.harness import read_bandwidth

    p = argparse.ArgumentParser(prog="python -m minivllm.bench quant_kernels",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--m", type=int, default=1, help="token rows (default 1)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = read_bandwidth("cpu", 2**28)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    for r in bench_quant_gemv(bw, m=args.m):
        print(f"{r['kernel']:<22}{r['shape']:<22}{r['ref_ms']:>9.3f} ms ref{r['fast_ms']:>9.4f} ms"
              f"{r['fast_GBps'] / 1e9:>7.1f} GB/s  {r['note']}; max err {r['max_abs_err']:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
