"""Offline throughput benchmark: ``minivllm bench throughput [--compare hf]``.

The fixed workload (seed 0): 64 requests whose prompts are random token ids
with lengths uniform in 16..256, and output lengths uniform in 16..128 with
``ignore_eos``, all submitted at once to ``LLM.generate``.

It reports output tokens/s and total (prompt + output) tokens/s, and puts the
latter against a compute roofline: the machine's measured fp32 (or the run's
dtype) GEMM rate divided by ``2 * num_parameters`` FLOPs per token. With
``--compare hf`` the same requests also run through transformers'
``generate`` (static batches of 8, left padding, greedy) and the ratio is
printed. Results go to JSON and a PNG chart.

``--compare llamacpp`` measures against llama.cpp's *own batched engine*
instead, on a workload both run the same way: B sequences of ``--prompt-len``
random prompt tokens that each generate ``--gen-len`` tokens, decoded together,
at every B of ``--batch-sizes`` (default 1 and 64), through
``llama-batched-bench``; plus one ``--prefill-len`` prompt (pp4096) and
``tg128`` through ``llama-bench``. llama.cpp runs F32, BF16, Q8_0 and Q4_1
GGUFs of the same weights (made from the shipped Q4_1 with ``llama-quantize
--allow-requantize``), minivllm runs float32 and bfloat16 (and int8 / int4 with
``--quantization`` where this minivllm has it), and the ratios of matching
pairs are printed in one run. The tools are built by ``minivllm bench llamacpp
--build DIR``; see :mod:`minivllm.bench.llamacpp`. Columns, as
llama-batched-bench defines them: total tok/s = B * (prompt + generated) /
whole time; decode tok/s = generated tokens / generation time (minivllm's
first token comes with its prefill step, so its decode time covers
``gen_len - 1`` tokens).

``--compare llamacpp-python`` is the older comparison through the Python
binding ``llama-cpp-python`` (the extra ``[llamacpp]``) on the 64-request
workload: it is *sequential*, one request at a time, so it does not measure
llama.cpp's batched engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from minivllm.bench._harness import describe_machine


def make_workload(num_requests: int, input_range: tuple[int, int],
                  output_range: tuple[int, int], vocab_size: int, seed: int = 0):
    """Random prompts and output lengths, reproducible from ``seed``."""
    rng = random.Random(seed)
    prompts, out_lens = [], []
    for _ in range(num_requests):
        n = rng.randint(*input_range)
        # Skip the lowest ids: they are special tokens in most vocabularies.
        prompts.append([rng.randint(100, vocab_size - 1) for _ in range(n)])
        out_lens.append(rng.randint(*output_range))
    return prompts, out_lens


def measure_gemm_flops(dtype: torch.dtype, device: torch.device, n: int = 1024,
                       seconds: float = 2.0) -> float:
    """FLOP/s of a square matmul, the compute roofline of this machine."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def run_minivllm(args, prompts, out_lens) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(args.model, backend=args.backend, dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in out_lens]
    # Warm up (kernel compilation, CUDA graphs, allocator) on a tiny request.
    llm.generate([{"prompt_token_ids": prompts[0][:8]}],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.scheduler.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != sum(out_lens):
        raise RuntimeError(f"expected {sum(out_lens)} output tokens, got {n_out}")
    engine = llm.llm_engine
    info = dict(device=str(engine.device), dtype=str(engine.dtype).replace("torch.", ""),
                backends=engine.components.describe())
    llm.shutdown()
    return dict(elapsed_s=elapsed, output_tokens=n_out, **info)


def count_parameters(model_dir: Path) -> int:
    """Parameters in the checkpoint, read from the safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if "rotary_emb" not in name:
                    total += _prod(st.get_slice(name).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_hf(model_dir: Path, prompts, out_lens, dtype: torch.dtype, device: torch.device,
           batch_size: int = 8, quiet: bool = False) -> dict:
    """transformers ``generate`` on the same requests: static batches, left padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = model.config.eos_token_id or 0
    if isinstance(pad, list):
        pad = pad[0]
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b : b + batch_size], out_lens[b : b + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=max(lens), min_new_tokens=max(lens),
                           pad_token_id=pad)
        if not quiet:
            print(f"  hf batch {b // batch_size + 1}/{-(-len(prompts) // batch_size)} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    # Count only the tokens each request asked for: the rest of a static batch is waste.
    return dict(elapsed_s=time.perf_counter() - start, output_tokens=sum(out_lens))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["minivllm"] + (["transformers"] if "hf" in result else [])
    out = [result["minivllm"]["output_tok_s"]] + (
        [result["hf"]["output_tok_s"]] if "hf" in result else [])
    total = [result["minivllm"]["total_tok_s"]] + (
        [result["hf"]["total_tok_s"]] if "hf" in result else [])
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], out, 0.4, label="output tokens/s")
    ax.bar([i + 0.2 for i in x], total, 0.4, label="total tokens/s")
    ax.axhline(result["roofline_tok_s"], color="k", ls="--", label="compute roofline (total)")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{result['model']} {result['dtype']} on {result['machine']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--backend", default=None, help="ref, fast, auto or an import path")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--compare", choices=["hf", "llamacpp", "llamacpp-python"], default=None,
                   help="hf: the same requests through transformers' generate; llamacpp: "
                        "llama.cpp's own batched engine (llama-batched-bench, llama-bench) on "
                        "the same weights at B=1 and B=64 (build it with `minivllm bench "
                        "llamacpp --build DIR`); llamacpp-python: the old SEQUENTIAL "
                        "one-request-at-a-time comparison through llama-cpp-python")
    g = p.add_argument_group("--compare llamacpp")
    g.add_argument("--llamacpp-dir", default=None,
                   help="llama.cpp build directory (default $MINIVLLM_LLAMACPP_DIR, then PATH)")
    g.add_argument("--gguf-dir", default=None,
                   help="where the F32/BF16/Q8_0 GGUFs are or are made (default "
                        "LLAMACPP_DIR/gguf)")
    g.add_argument("--formats", default="F32,BF16,Q8_0,Q4_1", help="llama.cpp GGUF formats")
    g.add_argument("--dtypes", default="float32,bfloat16", help="minivllm dtypes")
    g.add_argument("--quantization", default=None,
                   help="minivllm weight quantizations too (int8,int4,gguf), if LLM has quantization=")
    g.add_argument("--batch-sizes", default="1,64")
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--gen-len", type=int, default=64)
    g.add_argument("--prefill-len", type=int, default=4096, help="0 skips pp / tg")
    g.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    g.add_argument("--repeats", type=int, default=3,
                   help="alternated runs of each side; medians and spreads are reported")
    p.add_argument("--out", default="results/bench_throughput.json")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--busy-core", action="store_true",
                   help="measure (both engines, with --compare) while another process keeps "
                        "one core busy, started and stopped here: a laptop is never idle")
    args = p.parse_args(argv)
    from minivllm.bench._harness import busy_core

    with busy_core(args.busy_core):
        return _run(args)


def _run(args) -> int:
    """The measurements of :func:`main` (under ``--busy-core``'s load, if asked)."""

    from minivllm.engine.llm_engine import resolve_device, resolve_dtype
    from minivllm.model.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    if args.compare == "llamacpp":
        from minivllm.bench._vs_llamacpp import compare

        return compare(args, model_dir)
    if args.compare == "llamacpp-python":  # fail now, not after the long minivllm run
        from minivllm.bench.llamacpp import find_gguf, require_llama_cpp

        require_llama_cpp()
        find_gguf(args.model, model_dir)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts, out_lens = make_workload(args.num_requests, tuple(args.input_len),
                                      tuple(args.output_len), vocab, args.seed)
    n_in = sum(map(len, prompts))
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)

    mv = run_minivllm(args, prompts, out_lens)
    gemm = measure_gemm_flops(dtype, device)
    mv["num_params"] = count_parameters(model_dir)
    roofline = gemm / (2 * mv["num_params"])
    result = dict(
        model=args.model, dtype=mv["dtype"], machine=describe_machine() if device.type == "cpu" else "cuda"
        if device.type == "cpu" else torch.cuda.get_device_name(device),
        backend=args.backend, backends=mv["backends"], num_requests=args.num_requests,
        prompt_tokens=n_in, output_tokens=mv["output_tokens"], num_params=mv["num_params"],
        gemm_flops=gemm, roofline_tok_s=roofline,
        minivllm=dict(elapsed_s=mv["elapsed_s"], output_tok_s=mv["output_tokens"] / mv["elapsed_s"],
                      total_tok_s=(n_in + mv["output_tokens"]) / mv["elapsed_s"]),
    )
    result["roofline_fraction"] = result["minivllm"]["total_tok_s"] / roofline
    if args.compare == "hf":
        hf = run_hf(model_dir, prompts, out_lens, dtype, device, quiet=args.quiet)
        result["hf"] = dict(elapsed_s=hf["elapsed_s"],
                            output_tok_s=hf["output_tokens"] / hf["elapsed_s"],
                            total_tok_s=(n_in + hf["output_tokens"]) / hf["elapsed_s"])
        result["speedup_vs_hf"] = result["minivllm"]["output_tok_s"] / result["hf"]["output_tok_s"]

    if args.compare == "llamacpp-python":
        result["llamacpp"] = compare_llamacpp(args.model, model_dir, prompts, out_lens, n_in,
                                              result["minivllm"]["output_tok_s"], args.quiet)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))

    m = result["minivllm"]
    load = ", one core kept busy by another process" if args.busy_core else ""
    print(f"\nminivllm bench throughput: {args.num_requests} requests, {n_in} prompt + "
          f"{mv['output_tokens']} output tokens, {result['dtype']} on {result['machine']}{load}")
    print(f"{'engine':<14}{'seconds':>9}{'output tok/s':>14}{'total tok/s':>13}")
    print(f"{'minivllm':<14}{m['elapsed_s']:>9.1f}{m['output_tok_s']:>14.1f}{m['total_tok_s']:>13.1f}")
    if "hf" in result:
        h = result["hf"]
        print(f"{'transformers':<14}{h['elapsed_s']:>9.1f}{h['output_tok_s']:>14.1f}"
              f"{h['total_tok_s']:>13.1f}")
        print(f"speed-up vs transformers (output tokens/s): {result['speedup_vs_hf']:.2f}x")
    if "llamacpp" in result:
        c = result["llamacpp"]
        print(f"{'llama.cpp':<14}{c['elapsed_s']:>9.1f}{c['output_tok_s']:>14.1f}"
              f"{c['total_tok_s']:>13.1f}")
        print(f"speed-up vs llama.cpp (output tokens/s): {c['speedup']:.2f}x "
              f"({c['gguf']}, {c['threads']} threads, through llama-cpp-python: SEQUENTIAL, one "
              f"request at a time, not llama.cpp's batched engine)")
    print(f"GEMM rate {gemm / 1e9:.1f} GFLOP/s -> roofline {roofline:.1f} total tok/s; "
          f"minivllm reaches {100 * result['roofline_fraction']:.1f}% of it")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def compare_llamacpp(model: str, model_dir: Path, prompts, out_lens, n_in: int,
                     minivllm_out_tok_s: float, quiet: bool) -> dict:
    """Run the workload through llama.cpp on the model's GGUF; its tok/s and our ratio to it."""
    from minivllm.bench.llamacpp import find_gguf, run_llamacpp

    r = run_llamacpp(find_gguf(model, model_dir), prompts, out_lens, quiet=quiet)
    out_tok_s = r["output_tokens"] / r["elapsed_s"]
    return dict(elapsed_s=r["elapsed_s"], output_tok_s=out_tok_s,
                total_tok_s=(n_in + r["output_tokens"]) / r["elapsed_s"],
                speedup=minivllm_out_tok_s / out_tok_s, threads=r["threads"], gguf=r["gguf"])
