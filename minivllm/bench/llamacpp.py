r"""llama.cpp as the yardstick: its own batched engine, built from source, on the same weights.

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
    minivllm bench llamacpp --build DIR --no-amx             # a CPU whose AMX llama.cpp can't use

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


#: llama.cpp's switch for each x86 feature, by its /proc/cpuinfo flag (AMX left out).
GGML_FLAGS = MappingProxyType({
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16"})


def isa_options(no_amx: bool) -> str:
    """cmake's instruction-set options: ``-march=native``, or without AMX its features one
    by one from ``/proc/cpuinfo``.

    ``--no-amx`` exists for a machine whose CPU lists AMX while llama.cpp's AMX kernels do
    not run there: on the 2-core Xeon VM of issue 37 (flags ``amx_tile amx_int8``, Linux
    6.18), a native build died in ``ldtilecfg`` / ``tilezero`` (SIGSEGV, SIGILL) on every
    Q8_0 and Q4_1 run, while F32 ran. Without AMX, Q8_0 and Q4_1 run llama.cpp's AVX512-VNNI
    kernels.
    """
    if not no_amx:
        return "-DGGML_NATIVE=ON"
    from minivllm.bench._harness import cpu_flags

    have = set(cpu_flags(every=True))
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if flag in have else 'OFF'}"
                                            for flag, opt in GGML_FLAGS.items())])


def build_steps(build_dir: str | Path, jobs: int = 2, no_amx: bool = False) -> list[list[str]]:
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
         f"llama.cpp -B {shlex.quote(str(d))} -DCMAKE_BUILD_TYPE=Release {isa_options(no_amx)} "
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
    p.add_argument("--no-amx", action="store_true",
                   help="build for this CPU's features one by one, without AMX (where llama.cpp's "
                        "AMX kernels crash although the CPU lists AMX)")
    args = p.parse_args(argv)
    if args.print_steps or not (args.build or args.quantize):
        for cmd in build_steps(args.build or "DIR", args.jobs, args.no_amx):
            print(shlex.join(cmd))
        return 0
    if args.build:
        args.build = str(Path(args.build).expanduser().resolve())
        for cmd in build_steps(args.build, args.jobs, args.no_amx):
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
    only where it is also the LM head (one row of it is read otherwise). A weight with a
    prepacked copy counts once, as stored (the copy holds the same bytes, in another order,
    with rows padded to a panel's)."""
    from minivllm.fast.model_runner_hugepages import weight_tensors

    embed = model.model.embed_tokens.weight
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    tied = isinstance(head, torch.Tensor) and head.data_ptr() == embed.data_ptr()
    seen = {}  # data pointer -> bytes: a tied weight counts once
    for t in weight_tensors(model, buffers=False, packed=False):
        if t.data_ptr() == embed.data_ptr() and not tied:
            continue
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())
