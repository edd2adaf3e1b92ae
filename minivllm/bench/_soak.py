"""``minivllm bench serve --soak SECONDS``: a long run at a fixed fraction of capacity.

A short benchmark shows a server's speed; a long one shows whether it keeps it.
The soak runs in three parts, against the server of ``bench serve``:

1. **Capacity.** The request mix below, all at once (every request in flight):
   completed requests per second is the capacity.
2. **Soak.** Requests arrive as a Poisson process at ``--soak-fraction`` (0.8)
   of that capacity for SECONDS. Each one streams; the mix is seeded: prompt
   and output lengths drawn from ``--input-len`` / ``--output-len``, ``n`` = 2
   for one request in five, a regex constraint (structured outputs) for one in
   ten, one of ``--soak-adapters`` random LoRA adapters for one in ten, and one
   client in ten hangs up after a few tokens (the server must abort it and free
   its blocks).
3. **Report**, per window of ``--soak-window`` seconds: p50 / p99 of TTFT and
   ITL of the requests that arrived in it, the server's RSS (this process),
   requests in flight, errors; at the end, the KV blocks still in use once
   every request is done, and one greedy answer asked before and after.

The targets it checks (issue 35): p99 TTFT <= 5 s in every window, no 5xx
and no error event, no leaked block, RSS flat within 5% after the first
window (warm-up), the same greedy answer before and after.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

#: The regex a constrained request's completion must match.
SOAK_REGEX = "(yes|no), because [a-z ]{5,80}\\."
#: Targets (see the module docstring).
TTFT_P99_TARGET_S = 5.0
RSS_DRIFT_TARGET = 0.05


@dataclass(frozen=True)
class SoakRequest:
    """One request of the mix: when it arrives and what it asks."""

    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int
    n: int
    regex: bool
    adapter: str | None  # a LoRA adapter's served name, or None for the base model
    hang_up_after: int | None  # content chunks received before the client closes


@dataclass
class SoakResult:
    """What one request measured (seconds; ``status`` 0: no HTTP answer)."""

    at: float
    status: int = 0
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""
    hung_up: bool = False


def make_mix(num: int, rate: float, vocab: int, input_len: tuple[int, int],
             output_len: tuple[int, int], adapters: list[str], seed: int,
             hang_ups: bool = True) -> list[SoakRequest]:
    """``num`` requests arriving at ``rate`` per second (Poisson; ``inf``: all at once)."""
    rng = np.random.default_rng(seed)
    gaps = np.zeros(num) if math.isinf(rate) else rng.exponential(1.0 / rate, num)
    at = np.cumsum(gaps) - gaps[0]
    mix = []
    for i in range(num):
        length = int(rng.integers(input_len[0], input_len[1] + 1))
        mix.append(SoakRequest(
            at=float(at[i]), prompt=rng.integers(0, vocab, length).tolist(),
            max_tokens=int(rng.integers(output_len[0], output_len[1] + 1)),
            n=2 if rng.random() < 0.2 else 1, regex=bool(rng.random() < 0.1),
            adapter=adapters[int(rng.integers(len(adapters)))]
            if adapters and rng.random() < 0.1 else None,
            hang_up_after=int(rng.integers(1, 8)) if hang_ups and rng.random() < 0.1 else None))
    return mix


async def _one(client, url: str, model: str, req: SoakRequest, start: float,
               seed: int) -> SoakResult:
    body = {"model": req.adapter or model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "n": req.n, "temperature": 0.8 if req.n > 1 else 0.0, "seed": seed,
            "ignore_eos": True, "stream": True}
    if req.regex:
        body["structured_outputs"] = {"regex": SOAK_REGEX}
    res = SoakResult(at=time.perf_counter() - start)
    sent = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode()[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"][:200]
                    return res
                now = time.perf_counter()
                if math.isnan(res.ttft):
                    res.ttft = now - sent
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
                if req.hang_up_after is not None and chunks >= req.hang_up_after:
                    res.hung_up = True  # leaving the block closes the connection
                    return res
    except Exception as e:  # noqa: BLE001 -- a client-side failure is a result too
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


async def run_mix(base_url: str, model: str, mix: list[SoakRequest], seed: int,
                  on_tick=None, tick_s: float = 1.0) -> tuple[list[SoakResult], float]:
    """Send ``mix`` at its arrival times; ``on_tick(elapsed)`` every ``tick_s`` meanwhile.
    Returns the results (in mix order) and the wall time."""
    import httpx

    url = f"{base_url}/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        tasks = []

        async def ticker():
            while True:
                await asyncio.sleep(tick_s)
                on_tick(time.perf_counter() - start)

        tick = asyncio.create_task(ticker()) if on_tick else None
        for i, req in enumerate(mix):
            await asyncio.sleep(max(0.0, req.at - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(_one(client, url, model, req, start, seed + i)))
        results = await asyncio.gather(*tasks)
        if tick is not None:
            tick.cancel()
        return list(results), time.perf_counter() - start


def rss_bytes() -> float:
    """This process's resident set size (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return math.nan


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def windows(results: list[SoakResult], samples: list[tuple[float, float, int]],
            window_s: float, duration: float) -> list[dict]:
    """Per window: TTFT/ITL p50/p99 (s) of the requests that arrived in it, RSS and load."""
    rows = []
    for w in range(max(1, math.ceil(duration / window_s))):
        lo, hi = w * window_s, (w + 1) * window_s
        mine = [r for r in results if lo <= r.at < hi]
        ok = [r for r in mine if not math.isnan(r.ttft)]
        ttft, itl = [r.ttft for r in ok], [g for r in ok for g in r.itl]
        seen = [(rss, busy) for t, rss, busy in samples if lo <= t < hi]
        rows.append({"t_end_s": hi, "requests": len(mine),
                     "ttft_p50_s": _p(ttft, 50), "ttft_p99_s": _p(ttft, 99),
                     "itl_p50_s": _p(itl, 50), "itl_p99_s": _p(itl, 99),
                     "rss_mb": seen[-1][0] / 2**20 if seen else math.nan,
                     "in_flight": max((b for _, b in seen), default=0),
                     "errors": sum(1 for r in mine if r.error)})
    return rows


def verdict(rows: list[dict], results: list[SoakResult], leaked_blocks: int,
            same_answer: bool) -> dict[str, bool]:
    """Each target of the module docstring: met or not."""
    rss = [r["rss_mb"] for r in rows[1:] if not math.isnan(r["rss_mb"])]
    return {
        f"p99 TTFT <= {TTFT_P99_TARGET_S:g} s in every window": all(
            not r["ttft_p99_s"] > TTFT_P99_TARGET_S for r in rows),
        "no 5xx, no error event": not any(r.status >= 500 or r.error for r in results),
        "no leaked KV block": leaked_blocks == 0,
        f"RSS flat within {RSS_DRIFT_TARGET:.0%} after warm-up": not rss
        or max(rss) <= min(rss) * (1 + RSS_DRIFT_TARGET),
        "same greedy answer before and after": same_answer,
    }


def print_report(report: dict) -> None:
    print(f"\n=== soak: {report['duration_s']:.0f} s at {report['rate']:.2f} req/s "
          f"({report['fraction']:.0%} of {report['capacity']:.2f} req/s measured) ===")
    print(f"  {'t (s)':>6} {'reqs':>5} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
          f"{'RSS MB':>8} {'in flight':>9} {'errors':>6}")
    for r in report["windows"]:
        print(f"  {r['t_end_s']:>6.0f} {r['requests']:>5} {r['ttft_p50_s']:>9.3f} "
              f"{r['ttft_p99_s']:>7.3f} {r['itl_p50_s']:>8.3f} {r['itl_p99_s']:>7.3f} "
              f"{r['rss_mb']:>8.0f} {r['in_flight']:>9} {r['errors']:>6}")
    print(f"  requests {report['num_requests']}, hung up {report['hung_up']}, "
          f"5xx {report['num_5xx']}, error events {report['num_errors']}, "
          f"KV blocks in use at the end {report['leaked_blocks']}")
    for target, met in report["targets"].items():
        print(f"  [{'met' if met else 'MISSED'}] {target}")


def plot_soak(report: dict, ax_latency, ax_rss=None) -> None:
    """Latency over time (TTFT and ITL, p50 and p99 per window), RSS on a second axis."""
    rows = report["windows"]
    t = [r["t_end_s"] for r in rows]
    for key, style in (("ttft_p99_s", "o-"), ("ttft_p50_s", "o--"),
                       ("itl_p99_s", "s-"), ("itl_p50_s", "s--")):
        ax_latency.plot(t, [r[key] for r in rows], style, label=key[:-2].replace("_", " "))
    ax_latency.axhline(TTFT_P99_TARGET_S, color="tab:red", linestyle="--", linewidth=1,
                       label=f"p99 TTFT target ({TTFT_P99_TARGET_S:g} s)")
    ax_latency.set_yscale("log")
    ax_latency.set_xlabel("time into the soak (s)")
    ax_latency.set_ylabel("latency (s)")
    ax_latency.legend(fontsize=8)
    if ax_rss is not None:  # against the first window after warm-up, with the target band
        rss = [r["rss_mb"] for r in rows]
        base = next((v for v in rss[1:] if not math.isnan(v)), rss[0])
        change = [100 * (v / base - 1) for v in rss]
        ax_rss.plot(t, change, "k.-", label=f"RSS ({base:.0f} MB = 0)")
        for y in (-100 * RSS_DRIFT_TARGET, 100 * RSS_DRIFT_TARGET):
            ax_rss.axhline(y, color="tab:red", linestyle="--", linewidth=1)
        low, high = min(change + [-8.0]), max(change + [8.0])
        ax_rss.set_ylim(low, high)
        ax_rss.set_xlabel("time into the soak (s)")
        ax_rss.set_ylabel("server RSS change (%)")
        ax_rss.legend(fontsize=8, title=f"target: within {RSS_DRIFT_TARGET:.0%}",
                      title_fontsize=8)


def run_soak(engine, base_url: str, model: str, vocab: int, duration_s: float,
             fraction: float = 0.8, window_s: float = 30.0, input_len=(16, 256),
             output_len=(16, 128), adapters: list[str] = (), seed: int = 0,
             capacity_requests: int = 32) -> dict:
    """Parts 1-3 of the module docstring against the server at ``base_url``, which
    serves ``engine`` from this process; returns the report (see :func:`print_report`)."""
    import httpx

    def greedy() -> str:
        body = {"model": model, "prompt": "The three primary colours are", "max_tokens": 24,
                "temperature": 0.0}
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        return r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"

    before = greedy()
    burst = make_mix(capacity_requests, math.inf, vocab, input_len, output_len,
                     list(adapters), seed, hang_ups=False)
    done, took = asyncio.run(run_mix(base_url, model, burst, seed))
    capacity = sum(1 for r in done if not r.error) / took
    rate = fraction * capacity
    num = max(1, int(rate * duration_s))
    mix = [m for m in make_mix(num, rate, vocab, input_len, output_len, list(adapters),
                               seed + 1) if m.at < duration_s]
    samples: list[tuple[float, float, int]] = []
    sched = engine.scheduler

    def sample(elapsed: float) -> None:  # read from another thread: a snapshot is enough
        samples.append((elapsed, rss_bytes(), len(sched.running) + len(sched.waiting)))

    print(f"capacity {capacity:.2f} req/s ({len(done)} requests at once in {took:.1f} s); "
          f"soaking {duration_s:g} s at {rate:.2f} req/s ({len(mix)} requests) ...",
          flush=True)
    results, duration = asyncio.run(run_mix(base_url, model, mix, seed + 1, sample))
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.1)  # the hung-up requests' aborts, the last steps
    leaked = engine.cache_config.num_blocks - sched.num_free_blocks
    after = greedy()
    rows = windows(results, samples, window_s, duration)
    return {"capacity": capacity, "fraction": fraction, "rate": rate, "duration_s": duration,
            "num_requests": len(results), "hung_up": sum(r.hung_up for r in results),
            "num_5xx": sum(r.status >= 500 for r in results),
            "num_errors": sum(bool(r.error) for r in results),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "leaked_blocks": leaked, "greedy_before": before, "greedy_after": after,
            "windows": rows, "targets": verdict(rows, results, leaked, before == after)}


def main_soak(args) -> int:
    """``bench serve --soak``: build the engine (with adapters), serve it here, soak, report."""
    import platform
    import tempfile
    from pathlib import Path

    from minivllm import LLM
    from minivllm.bench._lora_e2e import write_random_adapter
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.entrypoints.openai.cli_args import load_lora_modules

    if args.base_url is not None:
        raise SystemExit("bench serve --soak serves its own engine (it reads its KV blocks "
                         "and RSS): leave out --base-url")
    k = args.soak_adapters
    lora = dict(enable_lora=True, max_loras=k, max_cpu_loras=k, max_lora_rank=16) if k else {}
    llm = LLM(args.model, backend=args.backend, dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, **lora)
    engine = llm.llm_engine
    with tempfile.TemporaryDirectory(prefix="minivllm-soak-") as tmp:
        specs = [f"soak-lora-{i}=" + str(write_random_adapter(
            Path(tmp) / f"a{i}", engine.executor.hf_config, 16, i)) for i in range(k)]
        modules = load_lora_modules(engine, specs, args.model)
        server = ServerThread.start(AsyncLLM(engine), args.model, lora_modules=modules)
        try:
            report = run_soak(engine, server.base_url, args.model, engine.vocab_size,
                              args.soak, args.soak_fraction, args.soak_window,
                              tuple(args.input_len), tuple(args.output_len), list(modules),
                              args.seed, args.num_requests)
        finally:
            server.stop()
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split(":")[1].split()} & {"avx2", "fma", "avx512f",
                                                             "avx512_vnni", "amx_tile"}) \
        if Path("/proc/cpuinfo").exists() else []
    report["machine"] = {"cpu": platform.processor() or platform.machine(),
                         "cores": os.cpu_count(), "flags": flags,
                         "loadavg_at_end": os.getloadavg()}
    print_report(report)
    out = Path(args.out).with_name(Path(args.out).stem + "_soak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    plot_soak(report, a, b)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0 if all(report["targets"].values()) else 1
