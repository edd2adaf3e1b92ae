"""llama.cpp as the yardstick: its own batched engine, built from source, on the same weights.

``minivllm bench throughput --compare llamacpp`` runs llama.cpp's own
benchmark tools, ``llama-batched-bench`` (B sequences decoded together, as
minivllm batches them) at B=1 and B=64 and ``llama-bench`` (``tg128`` decode,
``pp4096`` prefill), on GGUF files of the weights minivllm runs, and prints the
ratios in one run (:mod:`minivllm.bench.throughput`). The tools come from the
llama.cpp source vendored in the ``llama-cpp-python`` sdist, built with cmake;
this module does that for you and prints each step::

    minivllm bench llamacpp --build ~/llama.cpp-build        # about 4 minutes on 2 cores
    minivllm bench llamacpp --quantize ~/llama.cpp-build     # F32, BF16, Q8_0 from the Q4_1
    minivllm bench llamacpp --print-steps                    # just print the commands

or by hand (the same commands)::

    pip download --no-binary :all: --no-deps llama-cpp-python   # the sdist, into DIR/src
    tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B DIR -DCMAKE_BUILD_TYPE=Release \
          -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build DIR -j2 --target llama-batched-bench llama-bench llama-quantize

The comparison finds the tools in ``--llamacpp-dir`` (or ``$MINIVLLM_LLAMACPP_DIR``,
or on ``PATH``); a missing tool is an error that prints these steps.

SmolLM2 ships as a Q4_1 GGUF; minivllm runs its dequantized values. ``llama-quantize
--allow-requantize`` turns that file into F32, BF16 and Q8_0 files holding the same
values (F32 and BF16 exactly; Q8_0 re-rounds them), so each llama.cpp row runs
the weights minivllm runs in the matching dtype (float32 vs F32, bfloat16 vs BF16,
int8 vs Q8_0, 4-bit vs Q4_1).

The older comparison through the Python binding ``llama-cpp-python``
(``--compare llamacpp-python``, the optional extra ``[llamacpp]``) is kept
below. **It is sequential**: the binding serves one sequence at a time, so it
measures llama.cpp one request after another, not its batched engine; it is
not the yardstick for a batched engine. The binding is compiled from source
on install::

    pip install -e ".[llamacpp]"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import MappingProxyType

import torch

from minivllm.bench.harness import describe_machine, machine, read_bandwidth


def require_llama_cpp():
    """The binding's ``Llama`` class, or exit with a message naming the extra to install."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise SystemExit(
            "--compare llamacpp needs llama-cpp-python, the optional extra 'llamacpp': "
            "pip install -e '.[llamacpp]' (it compiles llama.cpp from source, which takes "
            f"several minutes). Import error: {e}"
        ) from e
    return Llama


def find_gguf(model: str, model_dir: Path) -> Path:
    """The GGUF file behind ``model``: a registered model's cached source, a ``.gguf``
    path itself, or the one ``.gguf`` in the model's directory."""
    from minivllm.model import registry

    if model in registry.ALIASES and registry.gguf_file(model) is not None:
        return Path(registry.gguf_file(model))
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        return model_dir
    found = sorted(model_dir.glob("*.gguf")) if model_dir.is_dir() else []
    if not found:
        raise SystemExit(
            f"--compare llamacpp needs the model's .gguf file; none found for {model!r} "
            f"(looked in {model_dir})"
        )
    return found[0]


def run_llamacpp(gguf: Path, prompts: list[list[int]], out_lens: list[int],
                 quiet: bool = False) -> dict:
    """Greedy generation of ``out_lens[i]`` tokens after ``prompts[i]``, one request at a time
    through the Python binding: sequential, not llama.cpp's batched engine.

    Returns ``elapsed_s`` (model loading and a short warm-up excluded) and
    ``output_tokens``.
    """
    Llama = require_llama_cpp()
    threads = os.cpu_count() or 1
    n_ctx = max(len(p) + n for p, n in zip(prompts, out_lens))
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                n_threads_batch=threads, seed=0, verbose=False)

    def generate(prompt: list[int], max_tokens: int) -> int:
        # reset=True starts from an empty KV cache (apart from a shared prefix, which
        # random prompts do not have). generate() never stops by itself: no EOS check.
        n = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, reset=True):
            n += 1
            if n == max_tokens:
                break
        return n

    generate(prompts[0][:8], 4)  # warm-up
    start = time.perf_counter()
    n_out = 0
    for i, (prompt, max_tokens) in enumerate(zip(prompts, out_lens)):
        n_out += generate(prompt, max_tokens)
        if not quiet and (i + 1) % 8 == 0:
            print(f"  llama.cpp request {i + 1}/{len(prompts)} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    elapsed = time.perf_counter() - start
    if n_out != sum(out_lens):
        raise RuntimeError(f"llama.cpp: expected {sum(out_lens)} output tokens, got {n_out}")
    return dict(elapsed_s=elapsed, output_tokens=n_out, threads=threads, gguf=gguf.name)


# ---------------------------------------------------------------- llama.cpp's own tools

#: The tools the comparison runs, and the one that makes the GGUF variants.
TOOLS = ("llama-batched-bench", "llama-bench", "llama-quantize")
#: GGUF variants made from the shipped Q4_1, and the minivllm setting each matches.
VARIANTS = MappingProxyType({"F32": "float32", "BF16": "bfloat16", "Q8_0": "int8", "Q4_1": "int4"})


def build_steps(build_dir: str | Path, jobs: int = 2) -> list[list[str]]:
    """The commands that build :data:`TOOLS` into ``build_dir`` (see the module docstring).

    The sdist's version is whatever pip finds; the vendored source is unpacked
    under ``build_dir/src``. ``nice`` keeps a loaded machine responsive.
    """
    d = Path(build_dir).expanduser()
    src = d / "src"
    return [
        ["mkdir", "-p", str(src)],
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(src),
         "llama-cpp-python"],
        ["sh", "-c", f"cd {shlex.quote(str(src))} && tar xzf llama_cpp_python-*.tar.gz"],
        ["sh", "-c", f"nice -n 10 cmake -S {shlex.quote(str(src))}/llama_cpp_python-*/vendor/"
         f"llama.cpp -B {shlex.quote(str(d))} -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "
         "-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF"],
        ["nice", "-n", "10", "cmake", "--build", str(d), f"-j{jobs}", "--target", *TOOLS],
    ]


def how_to_build() -> str:
    """A message with the commands that build the tools."""
    return ("build llama.cpp's tools first (about 4 minutes on 2 cores):\n"
            "    minivllm bench llamacpp --build DIR\n"
            "then pass --llamacpp-dir DIR (or set MINIVLLM_LLAMACPP_DIR=DIR). The steps:\n"
            + "\n".join("    " + shlex.join(c) for c in build_steps("DIR")))


def find_tool(name: str, build_dir: str | Path | None = None) -> Path:
    """``DIR/bin/name`` for ``build_dir`` or ``$MINIVLLM_LLAMACPP_DIR``, else ``name`` on
    ``PATH``; ``SystemExit`` with the build steps if it is nowhere."""
    dirs = [d for d in (build_dir, os.environ.get("MINIVLLM_LLAMACPP_DIR")) if d]
    for d in dirs:
        for cand in (Path(d).expanduser() / "bin" / name, Path(d).expanduser() / name):
            if cand.is_file() and os.access(cand, os.X_OK):
                return cand
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    looked = ", ".join(str(Path(d) / "bin") for d in dirs) or "PATH only"
    raise SystemExit(f"{name} not found (looked in {looked}); {how_to_build()}")


def gguf_variants(source: Path, out_dir: str | Path, build_dir=None) -> dict[str, Path]:
    """The F32, BF16 and Q8_0 GGUFs made from ``source`` (a Q4_1 file) in ``out_dir``,
    made with ``llama-quantize --allow-requantize`` where missing; plus the source itself."""
    out_dir = Path(out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    found = {"Q4_1": Path(source)}
    for fmt in ("F32", "BF16", "Q8_0"):
        path = out_dir / f"{Path(source).stem.split('.')[0]}.{fmt}.gguf"
        if not path.is_file():
            cmd = [str(find_tool("llama-quantize", build_dir)), "--allow-requantize",
                   str(source), str(path), fmt]
            print("+", shlex.join(cmd), flush=True)
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"llama-quantize failed: {done.stderr[-2000:]}")
        found[fmt] = path
    return found


def _jsonl(cmd: list[str]) -> list[dict]:
    """Run a tool; its JSON lines on stdout."""
    print("+", shlex.join(cmd), flush=True)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def batched_bench(gguf: Path, prompt_len: int, gen_len: int, batch_sizes: list[int],
                  threads: int, build_dir=None) -> dict[int, dict]:
    """``llama-batched-bench`` on ``gguf``: per batch size B, B sequences of ``prompt_len``
    prompt tokens each generating ``gen_len``, decoded together.

    Returns per B: ``total_tok_s`` (all prompt + generated tokens over the whole
    time), ``decode_tok_s`` (generated tokens over the generation time),
    ``prefill_tok_s`` and the raw seconds.
    """
    ctx = max(batch_sizes) * (prompt_len + gen_len) + 64
    rows = _jsonl([str(find_tool("llama-batched-bench", build_dir)), "-m", str(gguf),
                   "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
                   "-ntg", str(gen_len), "-npl", ",".join(map(str, batch_sizes)),
                   "-t", str(threads), "--output-format", "jsonl"])
    return {int(r["pl"]): dict(total_tok_s=r["speed"], decode_tok_s=r["speed_tg"],
                               prefill_tok_s=r["speed_pp"], t_pp=r["t_pp"], t_tg=r["t_tg"],
                               t=r["t"]) for r in rows}


def llama_bench(gguf: Path, prompt_len: int, gen_len: int, threads: int, repetitions: int = 1,
                build_dir=None) -> dict[str, float]:
    """``llama-bench``: ``pp{prompt_len}`` and ``tg{gen_len}`` tokens/s (means over repetitions)."""
    rows = _jsonl([str(find_tool("llama-bench", build_dir)), "-m", str(gguf),
                   "-p", str(prompt_len), "-n", str(gen_len), "-t", str(threads),
                   "-r", str(repetitions), "-o", "jsonl"])
    out = {}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        out[key] = float(r["avg_ts"])
    return out


def main(argv: list[str] | None = None) -> int:
    """``minivllm bench llamacpp --build DIR | --quantize DIR | --print-steps``."""
    p = argparse.ArgumentParser(prog="minivllm bench llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", metavar="DIR", help="download the sdist and build the tools in DIR")
    p.add_argument("--quantize", metavar="DIR",
                   help="make F32/BF16/Q8_0 GGUFs of the model in DIR/gguf (tools from DIR)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--print-steps", action="store_true", help="print the build commands only")
    args = p.parse_args(argv)
    if args.print_steps or not (args.build or args.quantize):
        for cmd in build_steps(args.build or "DIR", args.jobs):
            print(shlex.join(cmd))
        return 0
    if args.build:
        args.build = str(Path(args.build).expanduser().resolve())
        for cmd in build_steps(args.build, args.jobs):
            print("+", shlex.join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        for tool in TOOLS:
            print(f"built {find_tool(tool, args.build)}")
    if args.quantize:
        from minivllm.model.loader import resolve_model_path

        src = find_gguf(args.model, resolve_model_path(args.model))
        for fmt, path in gguf_variants(src, Path(args.quantize) / "gguf", args.quantize).items():
            print(f"{fmt:<5} {path}")
    return 0


# ---------------------------------------------------------------- the comparison

#: minivllm setting -> the llama.cpp format holding the same weights.
MATCHING = MappingProxyType({"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_1", "gguf": "Q4_1"})


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a batch-1 decode step reads: every weight once, the embedding table
    only where it is also the LM head (one row of it is read otherwise)."""
    from minivllm.fast.model_runner_hugepages import weight_tensors

    embed = model.model.embed_tokens.weight
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    tied = isinstance(head, torch.Tensor) and head.data_ptr() == embed.data_ptr()
    seen = {}  # data pointer -> bytes: a tied weight counts once
    for t in weight_tensors(model, buffers=False):
        if t.data_ptr() == embed.data_ptr() and not tied:
            continue
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


def _minivllm_rows(args, settings: list[tuple[str, str | None]], batch_sizes: list[int]):
    """B-sequence batches and the long prefill through minivllm, per (dtype, quantization)."""
    from minivllm.bench.latency import make_llm, random_prompts, time_batch

    rows = {}
    for dtype, quant in settings:
        name = quant or dtype
        llm = make_llm(args.model, dtype, quant, backend=args.backend, device=args.device,
                       max_num_seqs=max(batch_sizes), max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=max(args.prompt_len + args.gen_len, args.prefill_len + 1) + 16)
        vocab = llm.llm_engine.vocab_size
        time_batch(llm, random_prompts(1, 16, vocab, 1), 4)  # warm up
        row = {"weight_bytes": weight_bytes_per_token(llm.llm_engine.executor.worker.model)}
        for b in batch_sizes:
            t = time_batch(llm, random_prompts(b, args.prompt_len, vocab, args.seed),
                           args.gen_len)
            row[b] = dict(total_tok_s=b * (args.prompt_len + args.gen_len) / t.total_s,
                          decode_tok_s=b * (args.gen_len - 1) / max(t.decode_s, 1e-9),
                          t=t.total_s)
            print(f"  minivllm {name} B={b}: {row[b]['total_tok_s']:.1f} total tok/s", flush=True)
        if args.prefill_len:
            t = time_batch(llm, random_prompts(1, args.prefill_len, vocab, args.seed + 1), 1)
            row["prefill_tok_s"] = args.prefill_len / t.ttft_s
        llm.shutdown()
        rows[name] = row
    return rows


def compare(args, model_dir: Path) -> int:
    """``minivllm bench throughput --compare llamacpp``: both engines, ratios, one run."""
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    for tool in ("llama-batched-bench", "llama-bench"):  # fail now, before the long runs
        find_tool(tool, args.llamacpp_dir)
    source = find_gguf(args.model, model_dir)
    gguf_dir = args.gguf_dir or Path(args.llamacpp_dir or os.environ.get(
        "MINIVLLM_LLAMACPP_DIR", ".")) / "gguf"
    files = gguf_variants(source, gguf_dir, args.llamacpp_dir) if set(formats) - {"Q4_1"} \
        else {"Q4_1": source}
    settings = [(d, None) for d in args.dtypes.split(",") if d]
    quants = [q for q in (args.quantization or "").split(",") if q]
    settings += [("auto", q) for q in quants]  # activations in the default dtype, as a user runs it
    load_before = os.getloadavg()
    read_bw = read_bandwidth("cpu")  # the batch-1 roofline: read bandwidth / weight bytes

    ours = _minivllm_rows(args, settings, batch_sizes)
    theirs = {}
    for fmt in formats:
        row = batched_bench(files[fmt], args.prompt_len, args.gen_len, batch_sizes,
                            args.threads, args.llamacpp_dir)
        if args.prefill_len:
            row.update(llama_bench(files[fmt], args.prefill_len, 128, args.threads, 1,
                                   args.llamacpp_dir))
            row["prefill_tok_s"] = row.get(f"pp{args.prefill_len}")
        row["weight_bytes"] = files[fmt].stat().st_size  # the GGUF: its weights, read once
        theirs[fmt] = row

    b1, bmax = batch_sizes[0], batch_sizes[-1]
    lines = [f"minivllm vs llama.cpp's batched engine: {args.model}, {args.prompt_len} prompt "
             f"+ {args.gen_len} generated tokens per sequence, {args.threads} threads; load "
             f"average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
             f"{describe_machine()}"
             + ("; one core kept busy by another process (--busy-core)"
                if getattr(args, "busy_core", False) else ""),
             f"read bandwidth {read_bw / 1e9:.1f} GB/s (a float32 sum over 1 GiB, this run): "
             f"roofline = read bandwidth / weight bytes, the batch-1 decode ceiling",
             f"{'engine':<22}{f'B={b1} total':>12}{f'B={b1} decode':>13}{'roofline':>10}"
             f"{'of it':>7}{f'B={bmax} total':>13}{'prefill' + str(args.prefill_len):>13}"
             f"{'tg128':>8}"]

    def fmt_row(name, r):
        pre = r.get("prefill_tok_s")
        tg = r.get("tg128")
        roof = read_bw / r["weight_bytes"]
        return (f"{name:<22}{r[b1]['total_tok_s']:>12.1f}{r[b1]['decode_tok_s']:>13.1f}"
                f"{roof:>10.1f}{r[b1]['decode_tok_s'] / roof:>7.0%}"
                f"{r[bmax]['total_tok_s']:>13.1f}{'' if pre is None else f'{pre:.1f}':>13}"
                f"{'' if tg is None else f'{tg:.1f}':>8}")

    for fmt, r in theirs.items():
        lines.append(fmt_row(f"llama.cpp {fmt}", r))
    for name, r in ours.items():
        lines.append(fmt_row(f"minivllm {name}", r))
    lines.append("ratios minivllm / llama.cpp on the same weights:")
    for name, r in ours.items():
        fmt = MATCHING.get(name)
        if fmt not in theirs:
            continue
        t = theirs[fmt]
        parts = [f"B={b1} total {r[b1]['total_tok_s'] / t[b1]['total_tok_s']:.2f}x",
                 f"B={b1} decode {r[b1]['decode_tok_s'] / t[b1]['decode_tok_s']:.2f}x",
                 f"B={bmax} total {r[bmax]['total_tok_s'] / t[bmax]['total_tok_s']:.2f}x"]
        if r.get("prefill_tok_s") and t.get("prefill_tok_s"):
            parts.append(f"prefill {r['prefill_tok_s'] / t['prefill_tok_s']:.2f}x")
        lines.append(f"  {name} vs {fmt}: " + ", ".join(parts))
    print("\n".join(lines))
    out = Path(args.out).with_name("bench_vs_llamacpp.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(minivllm={k: {str(b): v for b, v in r.items()}
                                             for k, r in ours.items()},
                                   llamacpp={k: {str(b): v for b, v in r.items()}
                                             for k, r in theirs.items()},
                                   load_average=[load_before, os.getloadavg()],
                                   read_bandwidth=read_bw,
                                   machine=machine(),
                                   gguf={k: str(v) for k, v in files.items()}), indent=2))
    print(f"wrote {out}")
    return 0
