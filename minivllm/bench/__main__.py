"""``python -m minivllm.bench NAME [options]``: run ``minivllm.bench.NAME.main(options)``.

Benchmarks: ``latency`` (batch-1 TTFT and decode ms per token, host overhead), ``quant_kernels``
(the int8 / int4 decode GEMVs against the read bandwidth),
``throughput`` (end to end, offline; ``--compare hf|llamacpp``), ``serve`` (online, against
the HTTP server), ``host`` (allocator, block tables,
scheduler), ``sharing`` (blocks saved by fork and copy-on-write), ``kernels`` (Triton vs
ref), ``prefill`` (long prompts on a CPU: the GEMM-shaped
attention against the row loop, end to end), ``tp`` (tensor parallel), ``pp`` (pipeline
parallel: throughput, the bubble, memory per rank), ``kvcache`` (the int8 / fp8 KV cache:
capacity, a decode step at 4k x 16, perplexity), ``llamacpp``
(build llama.cpp's own benchmark tools and the GGUF weights they compare on).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import minivllm.bench


def available() -> list[str]:
    """Names of the benchmark modules in this package."""
    return sorted(m.name for m in pkgutil.iter_modules(minivllm.bench.__path__)
                  if not m.name.startswith("_"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m minivllm.bench NAME [options]; NAME is one of {names}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of {names}")
    result = importlib.import_module(f"minivllm.bench.{name}").main(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
