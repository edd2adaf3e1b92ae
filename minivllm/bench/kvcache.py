"""The quantized KV cache: ``minivllm bench kvcache [--context 4096] [--batch 16]``.

For each ``kv_cache_dtype`` (``auto``, the model's dtype; ``int8``; ``fp8``), in
one run, on one model (default SmolLM2-135M, float32 on a CPU):

- **capacity**: the bytes one token costs in the cache over all layers (K and
  V, the scales included: ``Worker.bytes_per_block``) and the tokens a
  ``--memory`` budget holds, against ``auto``;
- **speed** at ``--context`` tokens and ``--batch`` sequences: a decode step of
  the whole model (``Worker.execute_model``: the runner, the C++ layer stack on
  a CPU, and the LM head) over a cache already holding ``context`` tokens per
  sequence, and the attention op alone on one layer (the fast twin), with its
  GB/s (the cache bytes it must read: ``batch x context x 2 x H_kv x`` the row
  bytes, scales included) as a fraction of the read bandwidth measured in the
  same run. The cache is filled with random keys and values through the cache
  write (a decode step's time does not depend on the values, and a 16 x 4096
  prefill would take far longer than the measurement);
- **quality** (``--ppl``): perplexity of the model over
  :data:`~minivllm.bench._long_text.LONG_TEXT` (about 1,100 tokens, one prefill)
  with the cache stored each way, against ``auto``
  (:func:`minivllm.bench.quality.perplexity`).

Every table is printed with the machine (CPU, kernel flags, load average): a
ratio measured on a busy machine is a ratio, not a speed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from minivllm.bench._harness import describe_machine, machine, median_ms, read_bandwidth

FORMATS = ("auto", "int8", "fp8")


def _worker(model: str, dtype: torch.dtype, kv_cache_dtype: str, backend: str):
    from minivllm.engine.config import WorkerConfig
    from minivllm.worker.worker import Worker

    config = WorkerConfig(model=model, dtype=dtype, device=torch.device("cpu"),
                          kv_cache_dtype=kv_cache_dtype)
    return Worker(config, backend)


def _fill(worker, num_tokens: int, block_size: int, seed: int = 0) -> None:
    """Write random K/V (magnitude about 1, as normed activations) into the first
    ``num_tokens`` slots of every layer, through the cache write twin."""
    write = worker.components.cache_write.reshape_and_cache
    g = torch.Generator().manual_seed(seed)
    chunk = 4096
    for kv in worker.kv_caches:
        k_cache, v_cache, *scales = kv
        quant = dict(zip(("k_scale", "v_scale"), scales))
        for start in range(0, num_tokens, chunk):
            n = min(chunk, num_tokens - start)
            shape = (n, worker.num_kv_heads, worker.head_dim)
            key = torch.randn(shape, generator=g).to(worker.dtype)
            value = torch.randn(shape, generator=g).to(worker.dtype)
            slots = torch.arange(start, start + n, dtype=torch.int64)
            write(key, value, k_cache, v_cache, slots, **quant)


def bench_format(model: str, dtype: torch.dtype, kv_cache_dtype: str, context: int,
                 batch: int, block_size: int, memory: int, backend: str) -> dict:
    """Capacity, one decode step and the attention op at ``context`` x ``batch``."""
    from minivllm.metadata import StepInput

    worker = _worker(model, dtype, kv_cache_dtype, backend)
    block_bytes = worker.bytes_per_block(block_size)
    blocks_per_seq = math.ceil((context + 1) / block_size)
    worker.init_kv_cache(batch * blocks_per_seq, block_size, max_num_reqs=batch,
                         max_num_blocks_per_req=blocks_per_seq)
    _fill(worker, batch * blocks_per_seq * block_size, block_size)
    ids = tuple(f"r{i}" for i in range(batch))
    blocks = tuple(tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                   for i in range(batch))

    def step_input(first: bool) -> StepInput:
        # Each sequence decodes position `context` (its context + 1 keys); the first
        # step adds the rows and their blocks, the next ones repeat the same step.
        return StepInput(
            req_ids=ids, new_req_ids=frozenset(ids) if first else frozenset(),
            new_block_ids=blocks if first else ((),) * batch, removed_req_ids=(),
            query_lens=(1,) * batch, seq_lens=(context + 1,) * batch,
            input_ids=torch.randint(0, 1000, (batch,)),
            positions=torch.full((batch,), context, dtype=torch.int64),
            logits_indices=torch.arange(batch))
    worker.execute_model(step_input(True))
    step_ms = median_ms(lambda: worker.execute_model(step_input(False)))

    # The attention op alone, on layer 0, with this step's metadata.
    model_input = worker.prepare_model_input(step_input(False))
    k_cache, v_cache, *scales = worker.kv_caches[0]
    quant = dict(zip(("k_scale", "v_scale"), scales))
    attn = worker.model.model.layers[0].self_attn
    query = torch.randn(batch, attn.num_heads, attn.head_dim).to(dtype)
    op = worker.components.attention.paged_attention
    attn_ms = median_ms(lambda: op(query, k_cache, v_cache, model_input.attn_metadata,
                                   attn.scale, **quant))
    # Bytes the op must read: every sequence's keys and values (and their scales).
    row_bytes = block_bytes // (2 * worker.num_layers * block_size * worker.num_kv_heads)
    read = batch * (context + 1) * 2 * worker.num_kv_heads * row_bytes
    return dict(kv_cache_dtype=kv_cache_dtype, bytes_per_token=block_bytes // block_size,
                tokens_in_budget=memory // block_bytes * block_size, step_ms=step_ms,
                tok_s=batch / (step_ms * 1e-3), attn_ms=attn_ms,
                attn_GBps=read / (attn_ms * 1e-3) / 1e9)


def bench_perplexity(model: str, dtype: torch.dtype, formats, backend: str) -> dict:
    """Perplexity over LONG_TEXT with the cache stored in each format."""
    from minivllm.bench._long_text import LONG_TEXT
    from minivllm.bench.quality import perplexity

    worker = _worker(model, dtype, "auto", backend)
    tokens = worker.tokenizer.encode(LONG_TEXT)
    out = {"tokens": len(tokens)}
    for name in formats:
        out[name], argmax = perplexity(worker.model, tokens, kv_cache_dtype=name)
        out[f"{name}_argmax"] = argmax
    base = out.pop("auto_argmax")
    for name in formats:
        if name != "auto":
            agree = (out.pop(f"{name}_argmax") == base).float().mean().item()
            out[f"{name}_greedy_agreement"] = agree
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm bench kvcache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", help="the model's dtype (auto's cache dtype)")
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--context", type=int, default=4096, help="tokens cached per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences decoding at once")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--memory", type=int, default=1 << 30, help="KV budget for the capacity")
    p.add_argument("--backend", default="fast")
    p.add_argument("--threads", type=int, default=None, help="torch / C++ op threads")
    p.add_argument("--ppl", action="store_true", help="also perplexity over LONG_TEXT")
    p.add_argument("--out", default="results/bench_kvcache.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minivllm.dtype import DTYPES

    dtype = DTYPES[args.dtype]
    info = machine()
    print(f"minivllm bench kvcache: {args.model} {args.dtype}, context {args.context} x batch "
          f"{args.batch}, {torch.get_num_threads()} threads; {describe_machine(info)}",
          flush=True)
    bw = read_bandwidth("cpu", 1 << 28)
    print(f"read bandwidth (float32 sum over 256 MiB): {bw / 1e9:.1f} GB/s", flush=True)
    rows = []
    print(f"{'kv_cache_dtype':>14}{'B/token':>9}{'tokens/GiB':>12}{'x auto':>8}"
          f"{'step ms':>9}{'tok/s':>8}{'x auto':>8}{'attn ms':>9}{'GB/s':>7}{'% bw':>6}")
    for name in args.formats:
        r = bench_format(args.model, dtype, name, args.context, args.batch, args.block_size,
                         args.memory, args.backend)
        rows.append(r)
        base = rows[0]
        print(f"{name:>14}{r['bytes_per_token']:>9}{r['tokens_in_budget']:>12}"
              f"{r['tokens_in_budget'] / base['tokens_in_budget']:>7.2f}x"
              f"{r['step_ms']:>9.1f}{r['tok_s']:>8.1f}{base['step_ms'] / r['step_ms']:>7.2f}x"
              f"{r['attn_ms']:>9.2f}{r['attn_GBps']:>7.1f}{r['attn_GBps'] * 1e9 / bw:>6.0%}",
              flush=True)
    result = dict(machine=info, read_GBps=bw / 1e9, args=vars(args), formats=rows)
    if args.ppl:
        ppl = bench_perplexity(args.model, dtype, args.formats, args.backend)
        result["perplexity"] = ppl
        print(f"perplexity over LONG_TEXT ({ppl['tokens']} tokens, one prefill):")
        for name in args.formats:
            line = f"{name:>14}: {ppl[name]:.4f}"
            if name != "auto" and "auto" in ppl:
                line += (f"  ({ppl[name] / ppl['auto'] - 1:+.2%} vs auto; greedy agreement "
                         f"{ppl[f'{name}_greedy_agreement']:.1%})")
            print(line, flush=True)
    info_end = machine()
    result["load_average_end"] = info_end["load_average"]
    print(f"load average at the end: {info_end['load_average']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
