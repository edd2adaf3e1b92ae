"""``minivllm bench throughput --compare llamacpp``: both engines, alternated, against limits.

Every minivllm setting (float32, bfloat16, ``--quantization`` int8 / gguf ...)
and every llama.cpp GGUF format is measured ``--repeats`` times (3), the
sides alternated (:mod:`minivllm.bench._alternate`): each figure is a median
with its spread, and a spread over 15% marks it noisy. Each round first
measures the machine's own limits, with the same threads:

- **read bandwidth** (a float32 sum over 1 GiB): the batch-1 decode roofline of
  a row is bandwidth / the bytes of weights a step reads;
- **GEMM floor**: torch's own float GEMM at the decode step's shapes (each
  fused projection of every layer and the LM head, B rows) in the row's
  activation dtype; B / that time is the batch-B decode ceiling.

Each row prints its fraction of both. The CPU flags head the table, and the
load average before and after. The tools (``llama-batched-bench``,
``llama-bench``) and the GGUF files come from :mod:`minivllm.bench.llamacpp`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from minivllm.bench._alternate import Figure, alternate, as_json, figures
from minivllm.bench._harness import describe_machine, machine, median_ms, read_bandwidth
from minivllm.bench.llamacpp import (
    MATCHING,
    batched_bench,
    find_gguf,
    find_tool,
    gguf_variants,
    llama_bench,
    weight_bytes_per_token,
)


def gemm_floor_tok_s(hf_config, batch: int, dtype: torch.dtype) -> float:
    """Decode tokens/s if a step at ``batch`` rows took only torch's GEMMs at its shapes."""
    from minivllm.lora.models import module_shapes

    s = module_shapes(hf_config)
    hidden = hf_config.hidden_size
    qkv = s["q_proj"][1] + s["k_proj"][1] + s["v_proj"][1]
    shapes = [(hidden, qkv), s["o_proj"], (hidden, 2 * s["gate_proj"][1]), s["down_proj"]]
    seconds = 0.0
    for n_in, n_out in shapes:
        x, w = torch.randn(batch, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype)
        seconds += median_ms(lambda x=x, w=w: x @ w.T) * 1e-3 * hf_config.num_hidden_layers
    x, w = torch.randn(batch, hidden, dtype=dtype), torch.randn(hf_config.vocab_size, hidden,
                                                                dtype=dtype)
    seconds += median_ms(lambda: x @ w.T) * 1e-3  # the LM head
    return batch / seconds


def _ours(llm, args, batch_sizes: list[int]) -> dict:
    """One run of one minivllm setting: every batch size, then the long prefill."""
    from minivllm.bench.latency import random_prompts, time_batch

    vocab = llm.llm_engine.vocab_size
    row = {}
    for b in batch_sizes:
        t = time_batch(llm, random_prompts(b, args.prompt_len, vocab, args.seed), args.gen_len)
        row[b] = dict(total_tok_s=b * (args.prompt_len + args.gen_len) / t.total_s,
                      decode_tok_s=b * (args.gen_len - 1) / max(t.decode_s, 1e-9))
    if args.prefill_len:
        t = time_batch(llm, random_prompts(1, args.prefill_len, vocab, args.seed + 1), 1)
        row["prefill_tok_s"] = args.prefill_len / t.ttft_s
    return row


def _theirs(gguf: Path, args, batch_sizes: list[int]) -> dict:
    """One run of one llama.cpp format: ``llama-batched-bench``, then ``llama-bench``."""
    row = batched_bench(gguf, args.prompt_len, args.gen_len, batch_sizes, args.threads,
                        args.llamacpp_dir)
    if args.prefill_len:
        row.update(llama_bench(gguf, args.prefill_len, 128, args.threads, 1,
                               args.llamacpp_dir))
        row["prefill_tok_s"] = row.get(f"pp{args.prefill_len}")
    return row


def compare(args, model_dir: Path) -> int:
    """Both engines, ``args.repeats`` alternated runs each; medians, spreads, limits."""
    from minivllm.bench.latency import make_llm, random_prompts, time_batch

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
    settings += [("auto", q) for q in (args.quantization or "").split(",") if q]
    load_before = os.getloadavg()
    llms, weight_bytes, act_dtype = {}, {}, {}
    for dtype, quant in settings:  # loaded once, measured in every round
        llm = make_llm(args.model, dtype, quant, backend=args.backend, device=args.device,
                       max_num_seqs=max(batch_sizes),
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=max(args.prompt_len + args.gen_len,
                                         args.prefill_len + 1) + 16)
        time_batch(llm, random_prompts(1, 16, llm.llm_engine.vocab_size, 1), 4)  # warm up
        name = f"minivllm {quant or dtype}"
        llms[name] = llm
        weight_bytes[name] = weight_bytes_per_token(llm.llm_engine.executor.worker.model)
        act_dtype[name] = llm.llm_engine.dtype
    hf_config = next(iter(llms.values())).llm_engine.executor.hf_config
    for fmt in formats:
        weight_bytes[f"llama.cpp {fmt}"] = files[fmt].stat().st_size  # read once a step
        act_dtype[f"llama.cpp {fmt}"] = torch.bfloat16 if fmt == "BF16" else torch.float32
    bmax = batch_sizes[-1]

    def limits() -> dict:
        dtypes = set(act_dtype.values())
        return {"read_gb_s": read_bandwidth("cpu") / 1e9,
                **{f"gemm_floor_{d}": gemm_floor_tok_s(hf_config, bmax, d) for d in dtypes}}

    sides = {"limits": limits}
    # Pairs side by side (minivllm float32, llama.cpp F32, ...), so that alternation
    # puts the two halves of each ratio next to each other in time.
    for name, llm in llms.items():
        sides[name] = lambda llm=llm: _ours(llm, args, batch_sizes)
        fmt = MATCHING.get(name.split(" ", 1)[1])
        if fmt in formats and f"llama.cpp {fmt}" not in sides:
            sides[f"llama.cpp {fmt}"] = lambda fmt=fmt: _theirs(files[fmt], args, batch_sizes)
    for fmt in formats:
        sides.setdefault(f"llama.cpp {fmt}",
                         lambda fmt=fmt: _theirs(files[fmt], args, batch_sizes))
    runs = alternate(sides, args.repeats)
    for llm in llms.values():
        llm.shutdown()
    result = {name: figures(rows) for name, rows in runs.items()}
    lines = report(result, weight_bytes, act_dtype, batch_sizes, args, load_before)
    print("\n".join(lines))
    out = Path(args.out).with_name("bench_vs_llamacpp.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        figures=as_json(result), weight_bytes=weight_bytes, repeats=args.repeats,
        load_average=[load_before, os.getloadavg()], machine=machine(),
        gguf={k: str(v) for k, v in files.items()}), indent=2))
    print(f"wrote {out}")
    return 0


def report(result: dict, weight_bytes: dict, act_dtype: dict, batch_sizes: list[int],
           args, load_before) -> list[str]:
    """The table: medians±spread, each row's fraction of its limits, then the ratios."""
    lim = result["limits"]
    bw = lim["read_gb_s"].median * 1e9
    b1, bmax = batch_sizes[0], batch_sizes[-1]
    lines = [f"minivllm vs llama.cpp's batched engine: {args.model}, {args.prompt_len} prompt + "
             f"{args.gen_len} generated tokens per sequence, {args.threads} threads, "
             f"{args.repeats} alternated runs per row (median±spread; 'noisy': spread > 15%); "
             f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
             f"{describe_machine()}"
             + ("; one core kept busy by another process (--busy-core)"
                if getattr(args, "busy_core", False) else ""),
             f"limits, this run: read bandwidth {lim['read_gb_s']} GB/s -> B={b1} "
             f"roofline = bandwidth / weight bytes; GEMM floor at B={bmax} (torch's GEMM at "
             f"the step's shapes) " + ", ".join(
                 f"{k.removeprefix('gemm_floor_torch.')} {v} tok/s" for k, v in lim.items()
                 if k.startswith("gemm_floor")),
             f"{'engine':<20}{f'B={b1} decode':>16}{'roof':>7}{'of it':>6}"
             f"{f'B={bmax} decode':>17}{'of floor':>9}{f'B={bmax} total':>17}"
             f"{('prefill' + str(args.prefill_len)) if args.prefill_len else '':>17}"]
    for name, r in result.items():
        if name == "limits":
            continue
        roof = bw / weight_bytes[name]
        floor = lim[f"gemm_floor_{act_dtype[name]}"].median
        d1, dmax = r[b1]["decode_tok_s"], r[bmax]["decode_tok_s"]
        pre = r.get("prefill_tok_s")
        lines.append(f"{name:<20}{str(d1):>16}{roof:>7.1f}{d1.median / roof:>6.0%}"
                     f"{str(dmax):>17}{dmax.median / floor:>9.0%}"
                     f"{str(r[bmax]['total_tok_s']):>17}{'' if pre is None else str(pre):>17}")
    lines.append("ratios of medians, minivllm / llama.cpp on the same weights:")
    for name, r in result.items():
        fmt = MATCHING.get(name.split(" ", 1)[1]) if name.startswith("minivllm") else None
        t = result.get(f"llama.cpp {fmt}")
        if t is None:
            continue
        parts = [f"B={b} {key.split('_')[0]} {r[b][key].median / t[b][key].median:.2f}x"
                 + (" (noisy)" if r[b][key].noisy or t[b][key].noisy else "")
                 for b in dict.fromkeys((b1, bmax))  # once where B=1 is the only batch
                 for key in ("decode_tok_s", "total_tok_s")]
        if isinstance(r.get("prefill_tok_s"), Figure) and isinstance(t.get("prefill_tok_s"),
                                                                      Figure):
            parts.append(f"prefill {r['prefill_tok_s'].median / t['prefill_tok_s'].median:.2f}x")
        lines.append(f"  {name.split(' ', 1)[1]} vs {fmt}: " + ", ".join(parts))
    return lines
