"""Benchmarks, one module per subject: ``python -m minivllm.bench NAME [options]``.

Each module has ``main(argv) -> int`` and writes its results as JSON under
``results/`` (gitignored). ``host`` times the ref and fast twins of the
host-side components (block allocator, block tables, scheduler);
``kernels``, ``throughput`` and ``tp`` cover the device side.
"""
