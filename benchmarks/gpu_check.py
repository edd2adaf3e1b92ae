"""Helpers of ``benchmarks/gpu_check.sh``, plus a GPU-free compile check.

``python benchmarks/gpu_check.py aot``
    Compiles every Triton kernel of ``minivllm.fast`` for Hopper (sm_90) on
    a machine *without* a GPU: Triton's own compiler and ``ptxas`` run, only
    the launch is skipped. It calls the public functions with CPU tensors of
    the production dtypes and shapes, so the kernels get the same constexprs
    and specialisations as on a GPU, and prints each compiled variant's
    shared memory, registers and spills (from the cubin, via the
    ``cuobjdump`` shipped with Triton). This catches type errors that
    Triton's interpreter lets through, and configs that would not fit in a
    Hopper multiprocessor, before any GPU time is spent.

``python benchmarks/gpu_check.py make-model DIR``
    Saves a random-weight Llama (4 layers, hidden 2048, 16 query / 4 KV
    heads of dim 128, byte tokenizer) to ``DIR`` for the end-to-end
    throughput step: nothing is downloaded.

``python benchmarks/gpu_check.py summary RESULTS_DIR``
    Prints the final table of the GPU check from the JSON/XML files the
    shell script left in ``RESULTS_DIR``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HOPPER_SMEM = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


# ----------------------------------------------------------------------------- aot
def _install_fake_driver(capability: int = 90) -> list:
    """Point Triton at a pretend CUDA device and make every launch compile-only."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime import jit as jitmod

    class _CompileOnlyDriver:
        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_CompileOnlyDriver())
    compiled: list = []
    original = jitmod.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kwargs, kernel))
        return kernel

    jitmod.JITFunction.run = run
    return compiled


def _resource_usage(kernel) -> dict:
    """Registers / stack / local memory of a compiled kernel, read off its cubin."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                              capture_output=True, text=True).stdout  # fmt: skip
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in usage.items()}


def aot_check() -> int:
    """Compile every kernel variant the tests and the benchmark use; 1 if one cannot run."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    compiled = _install_fake_driver()
    import torch

    from minivllm import kv_quant
    from minivllm.fast import activation, attention, cache_write, layernorm, rotary
    from minivllm.fast.attention_decode import paged_decode_attention
    from minivllm.metadata import AttentionMetadata

    def batch(qlens, seq_lens, heads, kv_heads, d, bs, dtype):
        tables = torch.zeros(len(seq_lens), max(-(-s // bs) for s in seq_lens), dtype=torch.int32)
        md = AttentionMetadata.build(qlens, seq_lens, tables,
                                     torch.zeros(sum(qlens), dtype=torch.int64))
        q = torch.empty(sum(qlens), heads, d, dtype=dtype)
        kc = torch.empty(8, bs, kv_heads, d, dtype=dtype)
        return q, kc, kc.clone(), md

    failures = []
    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (16, 24, 40, 64, 80, 96, 128, 256):
            for heads, kv in ((4, 4), (8, 2), (5, 1), (32, 8)):
                cases.append((f"decode {dtype} d{d} h{heads}/{kv}",
                              batch([1, 1], [40, 1300], heads, kv, d, 16, dtype)))  # fmt: skip
                cases.append((f"decode-1part {dtype} d{d} h{heads}/{kv}",
                              batch([1, 1], [40, 300], heads, kv, d, 16, dtype)))  # fmt: skip
                cases.append((f"mixed {dtype} d{d} h{heads}/{kv}",
                              batch([1, 5], [40, 300], heads, kv, d, 16, dtype)))  # fmt: skip
                cases.append((f"prefill {dtype} d{d} h{heads}/{kv}",
                              batch([129, 5], [463, 18], heads, kv, d, 16, dtype)))  # fmt: skip
    # The Triton functions by name: the public ones send CPU tensors to the C++ ops.
    for name, (q, kc, vc, md) in cases:
        try:
            attention.paged_attention_triton(q, kc, vc, md, 0.1)
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
    # A quantized KV cache (kv_cache_dtype int8 / fp8): codes and a scale per row.
    for fmt, cache_dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in (64, 128):
                for kind, qlens, lens in (("decode", [1, 1], [40, 1300]),
                                          ("decode-1part", [1, 1], [40, 300]),
                                          ("prefill", [129, 5], [463, 18])):
                    q, kc, _, md = batch(qlens, lens, 32, 8, d, 16, dtype)
                    kc, vc = kc.to(cache_dtype), kc.to(cache_dtype)
                    ks = torch.empty(kc.shape[:3], dtype=kv_quant.SCALE_DTYPE)
                    try:
                        attention.paged_attention_triton(q, kc, vc, md, 0.1, k_scale=ks,
                                                         v_scale=ks.clone())
                    except Exception as e:
                        failures.append(f"{fmt} {kind} {dtype} d{d}: {type(e).__name__}: {e}")
                k = torch.empty(3, 8, d, dtype=dtype)
                cache = torch.empty(4, 16, 8, d, dtype=cache_dtype)
                scale = torch.empty(4, 16, 8)
                cache_write.reshape_and_cache_triton(k, k, cache, cache.clone(),
                                                     torch.zeros(3, dtype=torch.int64),
                                                     k_scale=scale, v_scale=scale.clone())
    q, kc, vc, md = batch([1, 1], [40, 1300], 4, 2, 16, 16, torch.float32)
    paged_decode_attention(q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc,
                           md.max_seq_len, 0.1, q.clone(), partition_size=64)  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hidden in (64, 1000, 4096, 8192):
            x = torch.empty(3, hidden, dtype=dtype)
            layernorm.rms_norm_triton(x, torch.empty(hidden, dtype=dtype), 1e-6)
            layernorm.fused_add_rms_norm_triton(x, x.clone(), torch.empty(hidden, dtype=dtype),
                                                1e-6)
        activation.silu_and_mul_triton(torch.empty(3, 2 * 14336, dtype=dtype))
        for neox in (True, False):
            rotary.apply_rotary_emb_triton(torch.zeros(3, dtype=torch.int64),
                                           torch.empty(3, 32, 128, dtype=dtype),
                                           torch.empty(3, 8, 128, dtype=dtype),
                                           torch.empty(64, 64), neox)  # fmt: skip
        k = torch.empty(3, 8, 128, dtype=dtype)
        cache = torch.empty(4, 16, 8, 128, dtype=dtype)
        cache_write.reshape_and_cache_triton(k, k, cache, cache.clone(),
                                             torch.zeros(3, dtype=torch.int64))

    seen, worst = set(), {}
    print(f"{'kernel':<28}{'warps':>6}{'stages':>7}{'smem KiB':>9}{'regs':>6}{'spill':>6}  key")
    for name, kw, kernel in compiled:
        key = (name, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key in seen:
            continue
        seen.add(key)
        usage = _resource_usage(kernel)
        smem = kernel.metadata.shared
        spill = usage.get("stack", 0) + usage.get("local", 0)
        if smem > HOPPER_SMEM:
            failures.append(f"{name} {kw}: {smem} bytes of shared memory > {HOPPER_SMEM}")
        w = worst.setdefault(name, [0, 0, 0])
        w[0], w[1], w[2] = max(w[0], smem), max(w[1], usage.get("reg", 0)), max(w[2], spill)
        consts = {k: v for k, v in kw.items() if k.isupper()}
        print(f"{name:<28}{kw.get('num_warps', 4):>6}{kw.get('num_stages', 3):>7}"
              f"{smem / 1024:>9.1f}{usage.get('reg', -1):>6}{spill:>6}  {consts}")  # fmt: skip
    print(f"\n{len(seen)} kernel variants compiled for sm_90; worst case per kernel:")
    for name, (smem, reg, spill) in worst.items():
        print(f"  {name:<28} smem {smem / 1024:.1f} KiB, {reg} registers, {spill} bytes spilled")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


# ----------------------------------------------------------------------------- summary
def _junit_counts(path: Path) -> str:
    if not path.exists():
        return "not run"
    text = path.read_text()
    tests = failures = errors = skipped = 0
    for m in re.finditer(r"<testsuite [^>]*>", text):
        tag = m.group(0)

        def attr(name, tag=tag):
            a = re.search(rf'{name}="(\d+)"', tag)
            return int(a.group(1)) if a else 0

        tests += attr("tests")
        failures += attr("failures")
        errors += attr("errors")
        skipped += attr("skipped")
    passed = tests - failures - errors - skipped
    return f"{passed} passed, {failures} failed, {errors} errors, {skipped} skipped"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary(results: Path) -> int:
    """The final table of the GPU check."""
    lines = ["", "=" * 78, "minivllm GPU check summary", "=" * 78]
    bench = _load(results / "bench_kernels.json")
    if bench and bench.get("rows"):
        lines.append(f"device: {bench['device']}; copy bandwidth {bench['copy_GBps']:.0f} GB/s")
        for r in bench["rows"]:
            extra = ""
            if "bandwidth_fraction" in r:
                extra = (f"  {r['fast_GBps'] / 1e9:.0f} GB/s = "
                         f"{100 * r['bandwidth_fraction']:.0f}% of measured bandwidth")  # fmt: skip
            elif "sdpa_over_fast" in r:
                extra = (f"  SDPA time / fast time = {r['sdpa_over_fast']:.2f} "
                         f"({r['fast_TFLOPs']:.0f} vs {r['sdpa_TFLOPs']:.0f} TFLOP/s)")  # fmt: skip
            elif "fast_GBps" in r:
                extra = f"  {r['fast_GBps'] / 1e9:.0f} GB/s"
            lines.append(f"  {r['kernel']:<20} fast vs ref {r['speedup']:7.1f}x"
                         f"  err {r['max_abs_err']:.1e}{extra}")  # fmt: skip
        for name, err in bench.get("errors", {}).items():
            lines.append(f"  {name}: FAILED {err}")
    else:
        lines.append("kernel benchmark: no results")
    e2e = {b: _load(results / f"e2e_{b}.json") for b in ("ref", "fast")}
    if all(e2e.values()):
        tok = {b: e2e[b]["minivllm"]["output_tok_s"] for b in e2e}
        lines.append(f"e2e throughput (output tok/s): ref {tok['ref']:.0f}, "
                     f"fast {tok['fast']:.0f}, fast/ref = {tok['fast'] / tok['ref']:.2f}")  # fmt: skip
    else:
        missing = [b for b, v in e2e.items() if not v]
        lines.append(f"e2e throughput: no result for {', '.join(missing)}")
    lines.append(f"kernel grid -m cuda:         {_junit_counts(results / 'junit_cuda.xml')}")
    lines.append(f"kernel tests on CUDA:        {_junit_counts(results / 'junit_kernels.xml')}")
    lines.append(f"other -m cuda tests:         {_junit_counts(results / 'junit_other.xml')}")
    steps = results / "steps.txt"
    if steps.exists():
        lines.append("step exit codes: " + " ".join(steps.read_text().split()))
    lines.append("=" * 78)
    print("\n".join(lines))
    return 0


# ----------------------------------------------------------------------------- model
def make_model(path: Path) -> int:
    """A random Llama with production-like attention shapes, built from the test fixtures."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import save_tiny_model

    save_tiny_model(path, "llama", seed=0, hidden_size=2048, num_attention_heads=16,
                    num_key_value_heads=4, intermediate_size=5632, num_hidden_layers=4,
                    max_position_embeddings=2048)  # fmt: skip
    print(f"saved a random 4-layer Llama (d_head 128, GQA 16/4) to {path}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["aot"]:
        return aot_check()
    if argv[:1] == ["make-model"] and len(argv) == 2:
        return make_model(Path(argv[1]))
    if argv[:1] == ["summary"] and len(argv) == 2:
        return summary(Path(argv[1]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main(sys.argv[1:]))
