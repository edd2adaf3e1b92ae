"""``minivllm bench throughput --compare llamacpp``: the same requests through llama.cpp.

llama.cpp runs the very GGUF file minivllm's registered model was converted
from (for SmolLM2-135M-Instruct, ``SmolLM2-135M-Instruct.Q4_1.gguf`` kept in
the model's cache directory), through its Python binding ``llama-cpp-python``.
The binding serves one sequence at a time (no continuous batching), so the
requests run one after another: the same prompt token ids, the same number of
output tokens (EOS is not checked, as with ``ignore_eos``), greedy sampling.
All CPU threads are given to it, as torch uses them all (the binding's
default is half of them).

Note the weights differ in form: llama.cpp computes on the Q4_1 blocks
directly, while minivllm runs the dequantised checkpoint in the benchmark's
dtype. The binding is an optional extra, compiled from source on install::

    pip install -e ".[llamacpp]"
"""

from __future__ import annotations

import os
import time
from pathlib import Path


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
    """Greedy generation of ``out_lens[i]`` tokens after ``prompts[i]``, one request at a time.

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
