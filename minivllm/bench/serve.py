"""Online serving benchmark: ``minivllm bench serve``, modelled on ``vllm bench serve``.

Requests (random token-id prompts, fixed output lengths with ``ignore_eos``,
the same workload as ``bench throughput``) are streamed to ``/v1/completions``
either at a **request rate** (arrival gaps drawn from a gamma distribution:
``--burstiness 1`` is a Poisson process, lower is burstier; ``inf`` sends all
at once), or with a **fixed concurrency** (``--max-concurrency``). Per request
it records:

- TTFT: time to the first token (queueing + prefill);
- TPOT: (end-to-end - TTFT) / (output tokens - 1), the request's decode pace;
- ITL: every gap between consecutive streamed tokens;
- E2EL: end-to-end latency;

and reports each as mean / median / p99, plus request and token throughput.

It starts the server in this process (``ServerThread``) unless ``--base-url``
points at a running one. ``--sweep 0.5,1,2,inf`` runs one pass per request
rate and plots p99 TTFT and throughput against the rate. ``--compare-offline``
measures the server's added cost on the same engine: ITL at concurrency 1
against the offline engine's time per decode step, and throughput with every
request in flight against ``LLM.generate`` on the same requests; then it sweeps
the rate to find the highest one keeping p99 TTFT under ``--ttft-slo``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request arrivals: gamma(shape=burstiness, mean=1/rate), or 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int
                      ) -> RequestResult:
    """Stream one completion; time the first token and the gaps between tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False, prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = (await r.aread()).decode()[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk["choices"]:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.ok = res.output_len == max_tokens
        if not res.ok:
            res.error = f"expected {max_tokens} tokens, got {res.output_len}"
    except Exception as e:  # a dropped connection: count it as failed, keep going
        res.error = repr(e)
    return res


async def run_pass(base_url: str, model: str, prompts, out_lens, rate: float,
                   burstiness: float, max_concurrency: int | None, seed: int) -> dict:
    """Send the whole workload once; return the summary of :func:`summarize`."""
    import httpx

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    url = f"{base_url}/v1/completions"
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)
                                 ) as client:
        async def limited(prompt, n):
            async with limit:
                return await one_request(client, url, model, prompt, n)

        tasks = []
        start = time.perf_counter()
        for gap, prompt, n in zip(arrival_gaps(len(prompts), rate, burstiness, seed),
                                  prompts, out_lens):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt, n)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate, max_concurrency)


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean / median / p99 (milliseconds by default)."""
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float, rate: float,
              max_concurrency: int | None) -> dict:
    """Latency statistics (ms) and throughputs of one pass."""
    ok = [r for r in results if r.ok]
    n_out = sum(r.output_len for r in ok)
    n_in = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }


def print_summary(s: dict, title: str) -> None:
    print(f"\n=== {title}: {s['completed']} ok, {s['failed']} failed, "
          f"{s['duration_s']:.1f} s ===")
    for e in s["errors"]:
        print(f"  error: {e}")
    print(f"  request throughput {s['request_throughput']:.2f} req/s, output "
          f"{s['output_throughput']:.1f} tok/s, total {s['total_token_throughput']:.1f} tok/s")
    print(f"  {'(ms)':<6}{'mean':>10}{'median':>10}{'p99':>10}")
    for key in ("ttft", "tpot", "itl", "e2el"):
        st = s[f"{key}_ms"]
        print(f"  {key.upper():<6}{st['mean']:>10.1f}{st['median']:>10.1f}{st['p99']:>10.1f}")


def plot_sweep(sweep: list[dict], path: Path, slo_s: float) -> None:
    """p99 TTFT and output throughput against the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [s for s in sweep if s["request_rate"] != "inf"]
    rates = [s["request_rate"] for s in finite]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(rates, [s["ttft_ms"]["p99"] / 1000 for s in finite], "o-", label="p99 TTFT")
    a.axhline(slo_s, color="r", ls="--", label=f"{slo_s:g} s target")
    a.set(xlabel="request rate (req/s)", ylabel="p99 TTFT (s)", yscale="log",
          title="latency to the first token")
    a.legend()
    b.plot(rates, [s["output_throughput"] for s in finite], "o-", label="output tok/s")
    b.set(xlabel="request rate (req/s)", ylabel="output tokens / s", title="throughput")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def offline_reference(engine, prompts, out_lens, num_single: int) -> dict:
    """On the same engine, before serving: the time of one decode step with ONE
    request in flight, and ``LLM.generate``-style throughput with all at once."""
    from minivllm import SamplingParams

    step_times = []
    for prompt, n in list(zip(prompts, out_lens))[:num_single]:
        engine.add_request(None, prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                        temperature=0.0))
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            _, stats = engine.step_with_stats()
            if stats.decode_req_ids:
                step_times.append(time.perf_counter() - t0)
    engine.scheduler.reset_prefix_cache()
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in out_lens]
    start = time.perf_counter()
    for prompt, sp in zip(prompts, params):
        engine.add_request(None, prompt, sp)
    n_out = 0
    while engine.has_unfinished_requests():
        n_out += len(engine.step())
    elapsed = time.perf_counter() - start
    engine.scheduler.reset_prefix_cache()
    return {"decode_step_ms": _stats(step_times), "output_throughput": n_out / elapsed,
            "duration_s": elapsed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minivllm bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None,
                   help="a running server (e.g. http://127.0.0.1:8000); default: start one "
                        "in this process")
    p.add_argument("--model", default="smollm2", help="model to serve (or its served name)")
    p.add_argument("--backend", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--sweep", default=None,
                   help="comma-separated request rates, one pass each, plotted (e.g. 1,2,4)")
    p.add_argument("--sweep-num-requests", type=int, default=None,
                   help="requests per sweep pass (default --num-requests); a pass at rate r "
                        "lasts at least N / r seconds")
    p.add_argument("--compare-offline", action="store_true",
                   help="print the server's added cost against the offline engine")
    p.add_argument("--repeats", type=int, default=2,
                   help="--compare-offline: offline/served rounds, best of each compared")
    p.add_argument("--num-single", type=int, default=4,
                   help="requests run one at a time for the concurrency-1 comparison")
    p.add_argument("--ttft-slo", type=float, default=2.0,
                   help="p99 TTFT target (s) for the highest sustainable rate")
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                   help="soak mode (minivllm.bench._soak): measure capacity, then a Poisson "
                        "load at --soak-fraction of it for SECONDS (e.g. 600), with hang-ups, "
                        "n=2, structured outputs and LoRA adapters; latency and RSS over time")
    p.add_argument("--soak-fraction", type=float, default=0.8)
    p.add_argument("--soak-window", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--soak-adapters", type=int, default=2,
                   help="random LoRA adapters (rank 16) served for the soak's mix (0: none)")
    p.add_argument("--out", default="results/bench_serve.json")
    args = p.parse_args(argv)
    if args.soak is not None:
        from minivllm.bench._soak import main_soak

        return main_soak(args)
    if args.compare_offline and args.base_url:
        p.error("--compare-offline measures the offline engine in this process: "
                "leave out --base-url")

    from transformers import AutoConfig

    from minivllm.bench.throughput import make_workload
    from minivllm.model.loader import resolve_model_path

    server = offline = None
    if args.base_url is None:
        from minivllm import LLM, SamplingParams
        from minivllm.engine.async_llm import AsyncLLM
        from minivllm.entrypoints.openai.api_server import ServerThread

        llm = LLM(args.model, backend=args.backend, dtype=args.dtype, device=args.device,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        vocab = llm.llm_engine.vocab_size
    else:
        vocab = AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    prompts, out_lens = make_workload(args.num_requests, tuple(args.input_len),
                                      tuple(args.output_len), vocab, args.seed)
    result: dict = {"model": args.model, "num_requests": args.num_requests,
                    "input_len": list(args.input_len), "output_len": list(args.output_len)}
    if args.base_url is None:
        # Warm up (allocator, first shapes) on a few real requests of the workload.
        llm.generate([{"prompt_token_ids": q} for q in prompts[:4]],
                     [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens[:4]],
                     use_tqdm=False)
        llm.llm_engine.scheduler.reset_prefix_cache()
        server = ServerThread.start(AsyncLLM(llm.llm_engine), args.model)
    base_url = args.base_url or server.base_url

    def run(rate, concurrency, prompts_=prompts, lens_=out_lens):
        return asyncio.run(run_pass(base_url, args.model, prompts_, lens_, rate,
                                    args.burstiness, concurrency, args.seed))

    try:
        if args.compare_offline:
            # Offline and served passes alternate (A B A B ...), each on the same
            # engine and requests, and the best of each is compared: on a shared,
            # noisy machine that is fairer than one pass of each. While the offline
            # pass runs, no request is in flight, so the server's engine loop sleeps.
            k, reps = args.num_single, []
            for rep in range(args.repeats):
                print(f"round {rep + 1}/{args.repeats}: offline reference ...", flush=True)
                off = offline_reference(llm.llm_engine, prompts, out_lens, k)
                single = run(math.inf, 1, prompts[:k], out_lens[:k])
                print_summary(single, "server, concurrency 1")
                llm.llm_engine.scheduler.reset_prefix_cache()
                full = run(math.inf, None)
                print_summary(full, f"server, all {args.num_requests} requests at once")
                llm.llm_engine.scheduler.reset_prefix_cache()
                reps.append({"offline": off, "server_concurrency_1": single,
                             "server_all_at_once": full})
            result["rounds"] = reps
            offline = min((r["offline"] for r in reps),
                          key=lambda o: o["decode_step_ms"]["mean"])
            result["offline"] = {
                "decode_step_ms": offline["decode_step_ms"],
                "output_throughput": max(r["offline"]["output_throughput"] for r in reps)}
            result["server_concurrency_1"] = min(
                (r["server_concurrency_1"] for r in reps), key=lambda x: x["itl_ms"]["mean"])
            result["server_all_at_once"] = max(
                (r["server_all_at_once"] for r in reps), key=lambda x: x["output_throughput"])
            rates = [float(r) for r in (args.sweep or "0.5,1,2,4").split(",")]
        else:
            main_pass = run(args.request_rate, args.max_concurrency)
            print_summary(main_pass, f"rate {args.request_rate:g} req/s, max concurrency "
                                     f"{args.max_concurrency}")
            result["serve"] = main_pass
            rates = [float(r) for r in args.sweep.split(",")] if args.sweep else []
        sweep = []
        m = args.sweep_num_requests or args.num_requests
        for rate in rates:
            s = run(rate, args.max_concurrency, prompts[:m], out_lens[:m])
            print_summary(s, f"sweep: {rate:g} req/s")
            sweep.append(s)
    finally:
        if server is not None:
            server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if sweep:
        result["sweep"] = sweep
        ok = [s["request_rate"] for s in sweep if s["request_rate"] != "inf"
              and s["failed"] == 0 and s["ttft_ms"]["p99"] <= 1000 * args.ttft_slo]
        result["max_rate_within_ttft_slo"] = max(ok) if ok else None
        plot_sweep(sweep, out.with_suffix(".png"), args.ttft_slo)
    if offline is not None:
        report_comparison(result, args.ttft_slo)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}" + (f" and {out.with_suffix('.png')}" if sweep else ""))
    return 0


def report_comparison(result: dict, slo_s: float) -> None:
    """Print the server's added cost against the offline engine (ratios of one run)."""
    off, one, full = result["offline"], result["server_concurrency_1"], \
        result["server_all_at_once"]
    itl_ratio = one["itl_ms"]["mean"] / off["decode_step_ms"]["mean"]
    tput_ratio = full["output_throughput"] / off["output_throughput"]
    result["comparison"] = {"itl_over_offline_step": itl_ratio,
                            "throughput_over_offline": tput_ratio}
    print("\n=== the server's added cost (same engine, same requests, one run) ===")
    print(f"  concurrency 1: mean ITL {one['itl_ms']['mean']:.1f} ms vs offline decode step "
          f"{off['decode_step_ms']['mean']:.1f} ms: {itl_ratio:.3f}x  (target <= 1.10)")
    print(f"  all at once:   {full['output_throughput']:.1f} vs offline "
          f"{off['output_throughput']:.1f} output tok/s: {100 * tput_ratio:.1f}%  "
          f"(target >= 90%)")
    best = result.get("max_rate_within_ttft_slo")
    print(f"  highest swept rate with p99 TTFT <= {slo_s:g} s: "
          f"{'none' if best is None else f'{best:g} req/s'}")
