"""The LoRA delta on SmolLM2's shapes: the ref's token loop against the segmented kernel.

``python -m minivllm.bench lora [--threads T] [--dtype float32|bfloat16] [--rank 16]``

For one decoder layer of SmolLM2-135M (hidden 576, 9 query heads and 3 KV heads of
64, intermediate 1536), the four fused projections and their seven output slices:

- ``qkv_proj`` 576 -> 576 | 192 | 192, ``o_proj`` 576 -> 576,
- ``gate_up_proj`` 576 -> 1536 | 1536, ``down_proj`` 1536 -> 576,

every slice adapted at rank ``r`` (16) by each of ``max_loras`` = 8 slots. A batch of
``T`` tokens (1 or 64) is spread round-robin over ``n`` distinct adapters (1, 4, 8;
``n <= T``), and one layer's delta is timed three ways:

- ``ref``: :func:`minivllm.ref.lora.add_lora`, one token at a time;
- ``fast``: :func:`minivllm.fast.lora.add_lora` (the C++ op on a CPU, Triton on CUDA);
- ``base``: the layer's four base projections (``minivllm.fast.linear.linear``), for
  scale: the delta's cost as a fraction of the work it rides on.

The delta's arithmetic is ``2 * T * r * sum(in + out_i)`` flops over the seven slices
(the shrink reads ``in`` per rank row, the expand writes ``out_i``), and it reads
``n * r * sum(in + out_i)`` adapter weights: GFLOP/s below uses that formula.

The end-to-end part (``--e2e``: B = 1 and 64 requests with 1 / 4 / 8 adapters
against the base model, through ``LLM(..., enable_lora=True)``) is
:mod:`minivllm.bench._lora_e2e`.
"""

from __future__ import annotations

import argparse
from types import MappingProxyType

import torch

#: SmolLM2-135M: fused projection -> (in features, output slices).
PROJECTIONS = MappingProxyType({
    "qkv_proj": (576, (576, 192, 192)),
    "o_proj": (576, (576,)),
    "gate_up_proj": (576, (1536, 1536)),
    "down_proj": (1536, (576,)),
})
MAX_LORAS = 8


def make_layer(rank: int, dtype: torch.dtype, device: str, seed: int = 0,
               max_loras: int = MAX_LORAS) -> dict:
    """One layer's stacks (``max_loras`` slots, every one filled) and base weights."""
    g = torch.Generator().manual_seed(seed)
    layer = {}
    for name, (k, slices) in PROJECTIONS.items():
        layer[name] = dict(
            lora_a=[(torch.randn(max_loras, rank, k, generator=g) / k**0.5).to(dtype).to(device)
                    for _ in slices],
            lora_b=[(torch.randn(max_loras, rank, n, generator=g) / rank**0.5).to(dtype)
                    .to(device) for n in slices],
            scalings=[torch.full((max_loras,), 2.0, device=device) for _ in slices],
            output_slices=list(slices),
            weight=(torch.randn(sum(slices), k, generator=g) / k**0.5).to(dtype).to(device))
    return layer


def delta_flops(num_tokens: int, rank: int) -> int:
    """Multiply-adds x 2 of one layer's delta for ``num_tokens`` tokens."""
    return 2 * num_tokens * rank * sum(k + n for k, slices in PROJECTIONS.values() for n in slices)


def time_layer(layer: dict, num_tokens: int, num_adapters: int, dtype: torch.dtype,
               device: str) -> dict:
    """Median ms of one layer's delta by the ref and the fast twin, and of its base GEMMs."""
    from minivllm.bench._harness import median_ms as _bench
    from minivllm.fast import linear as fast_linear
    from minivllm.fast import lora as fast_lora
    from minivllm.lora.mapping import LoRAMapping
    from minivllm.ref import lora as ref_lora

    g = torch.Generator().manual_seed(1)
    mapping = LoRAMapping.build([t % num_adapters for t in range(num_tokens)], device)
    xs = {name: torch.randn(num_tokens, k, generator=g).to(dtype).to(device)
          for name, (k, _) in PROJECTIONS.items()}
    ys = {name: torch.zeros(num_tokens, sum(s), dtype=dtype, device=device)
          for name, (_, s) in PROJECTIONS.items()}

    def delta(impl):
        for name, p in layer.items():
            impl.add_lora(ys[name], xs[name], p["lora_a"], p["lora_b"], p["scalings"], mapping,
                          p["output_slices"])

    def base():
        for name, p in layer.items():
            fast_linear.linear(xs[name], p["weight"])

    for y in ys.values():
        y.zero_()
    delta(fast_lora)
    fast_out = {n: y.clone() for n, y in ys.items()}
    for y in ys.values():
        y.zero_()
    delta(ref_lora)
    err = max((fast_out[n].float() - ys[n].float()).abs().max().item() for n in ys)
    return dict(ref_ms=_bench(lambda: delta(ref_lora)), fast_ms=_bench(lambda: delta(fast_lora)),
                base_ms=_bench(base), max_abs_err=err)


def run(rank: int = 16, dtype: torch.dtype = torch.float32, device: str = "cpu",
        token_counts=(1, 64), adapter_counts=(1, 4, 8)) -> list[dict]:
    """One row per (tokens, adapters) with ``adapters <= tokens``."""
    layer = make_layer(rank, dtype, device, max_loras=max(adapter_counts))
    rows = []
    for t in token_counts:
        for n in adapter_counts:
            if n > t:
                continue
            r = time_layer(layer, t, n, dtype, device)
            r.update(tokens=t, adapters=n, speedup=r["ref_ms"] / r["fast_ms"],
                     overhead=r["fast_ms"] / r["base_ms"],
                     fast_GFLOPs=delta_flops(t, rank) / (r["fast_ms"] * 1e6))
            rows.append(r)
    return rows


# ----------------------------------------------------------------- LEAD: end-to-end hook
def end_to_end(args: argparse.Namespace) -> list[dict]:
    """B = 1 and B = 64 requests with 1 / 4 / 8 adapters against the base model
    (:mod:`minivllm.bench._lora_e2e`)."""
    from minivllm.bench import _lora_e2e as lora_e2e

    return lora_e2e.run(args.model, rank=args.rank, output_len=args.output_len,
                        repeats=args.repeats)


def main(argv: list[str] | None = None) -> int:
    """Print one layer's delta: ref vs fast, and fast as a fraction of the base GEMMs."""
    p = argparse.ArgumentParser(prog="python -m minivllm.bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--e2e", action="store_true",
                   help="also the end-to-end rows: LLM.generate with B = 1, 64 and 1 / 4 / 8 "
                        "adapters against the base model (minivllm.bench._lora_e2e)")
    p.add_argument("--model", default="smollm2", help="--e2e: the base model")
    p.add_argument("--output-len", type=int, default=32, help="--e2e: tokens per request")
    p.add_argument("--repeats", type=int, default=3,
                   help="--e2e: rounds, base and LoRA engines alternated (medians printed)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from minivllm.fast import cpu_ops

        if not cpu_ops.available():
            raise SystemExit(f"the C++ CPU kernels are not available "
                             f"({cpu_ops.unavailable_reason()}): nothing to time")
    dtype = getattr(torch, args.dtype)
    print(f"LoRA delta, one SmolLM2 layer (7 slices), rank {args.rank}, {args.dtype}, "
          f"{device}, {torch.get_num_threads()} threads")
    print(f"{'tokens':>6} {'adapters':>8} {'ref ms':>9} {'fast ms':>9} {'speed-up':>9} "
          f"{'base ms':>9} {'delta/base':>10} {'GFLOP/s':>8} {'max err':>8}")
    for r in run(args.rank, dtype, device):
        print(f"{r['tokens']:>6} {r['adapters']:>8} {r['ref_ms']:>9.3f} {r['fast_ms']:>9.4f} "
              f"{r['speedup']:>8.1f}x {r['base_ms']:>9.4f} {100 * r['overhead']:>9.1f}% "
              f"{r['fast_GFLOPs']:>8.2f} {r['max_abs_err']:>8.1g}")
    if args.e2e:
        end_to_end(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
