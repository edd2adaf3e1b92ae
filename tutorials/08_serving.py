"""
08 · Serving: latency against throughput
========================================

Offline, an engine is judged by one number: tokens per second. A server has
users waiting, and two more numbers matter:

- **TTFT**, time to the first token: how long a user stares at nothing
  (queueing + the prefill of the prompt);
- **ITL**, inter-token latency: how fast the words then appear (one decode
  step of the whole batch per token).

You will learn:

1. how ``minivllm serve`` turns the step-by-step ``LLMEngine`` into an online
   server (``AsyncLLM``: one engine thread, an asyncio queue per request), and
   how to stream a reply from it with the ``openai`` client;
2. what happens to TTFT and throughput as the **request rate** grows: below
   capacity TTFT is just the prefill; above it, requests queue and TTFT
   explodes while throughput flattens;
3. how **chunked prefill** (``max_num_batched_tokens``) trades the two
   latencies: a small token budget splits long prompts over several steps, so
   the running requests' decode steps stay short (low ITL) but new requests
   wait longer for their first token (higher TTFT);
4. how the server sees the same load from the inside: its ``/metrics`` (vLLM's
   metric names), scraped during a run and drawn as the main panels of vLLM's
   Grafana dashboard.

Everything runs on a CPU with SmolLM2-135M and a deliberately small workload,
so the numbers are noisy; the shapes of the curves are the lesson.
"""

# %%
import asyncio
import math
import time

import matplotlib

matplotlib.use("Agg")  # no window: the figures are saved as PNGs
import httpx
import matplotlib.pyplot as plt
import numpy as np
import openai
from _figures import figure_path  # tutorials/figures/, ignored by git
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM
from minivllm.bench.serve import run_pass
from minivllm.bench.throughput import make_workload
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import ServerThread

MODEL = "smollm2"


def start_server(max_num_batched_tokens: int, max_num_seqs: int = 256
                 ) -> tuple[ServerThread, int]:
    """Load the model, wrap its engine in AsyncLLM and serve it on a free local port.

    Returns the running server and the model's vocabulary size."""
    llm = LLM(MODEL, device="cpu", max_model_len=1024, backend="auto",
              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return ServerThread.start(AsyncLLM(llm.llm_engine), MODEL), llm.llm_engine.vocab_size


# %% [markdown]
# 1. Start the server and stream a reply
# --------------------------------------
#
# ``ServerThread`` runs the same FastAPI app as ``minivllm serve`` (the command
# line), in a background thread of this process. Any OpenAI client can talk
# to it; ``stream=True`` gets Server-Sent Events, one chunk per engine step.

# %%
server, vocab_size = start_server(max_num_batched_tokens=512)
client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
stream = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "What is a KV cache? One sentence."}],
    max_tokens=40, temperature=0, stream=True)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
server.stop()

# %% [markdown]
# 2. Sweep the request rate
# -------------------------
#
# ``minivllm bench serve`` sends requests with random (Poisson) arrival gaps at
# a given rate and measures every token's arrival time. We reuse its
# ``run_pass`` with a short workload: 12 requests, prompts of 32-128 tokens, 16
# output tokens each, on a server that runs at most 8 requests at once
# (``max_num_seqs=8``), so that it has a capacity we can exceed.
#
# A CPU's speed varies by a factor of ten from one laptop to another, so the
# rates are chosen from this machine's capacity. First a **warm-up** request
# pays the one-time costs (the first call of each kernel), then a **burst** (all
# 12 requests at once) measures the saturated throughput, and from it the rate
# ``capacity`` at which requests arrive exactly as fast as the server finishes
# them. The sweep then offers half of that up to four times it.

# %%
N, OUT = 12, 16
prompts, out_lens = make_workload(N, (32, 128), (OUT, OUT), vocab_size, seed=0)


def measure(url: str, rate: float) -> dict:
    return asyncio.run(run_pass(url, MODEL, prompts, out_lens, rate, burstiness=1.0,
                                max_concurrency=None, seed=0))


server, _ = start_server(max_num_batched_tokens=512, max_num_seqs=8)
asyncio.run(run_pass(server.base_url, MODEL, prompts[:1], [4], math.inf, burstiness=1.0,
                     max_concurrency=None, seed=0))  # warm-up
burst = measure(server.base_url, math.inf)  # all at once: the saturated throughput
capacity = burst["output_throughput"] / OUT  # requests per second the server can finish
print(f"saturated: {burst['output_throughput']:.1f} output tok/s = {capacity:.2f} req/s")
rates = [capacity * f for f in (0.5, 1.0, 2.0, 4.0)]
by_rate = [measure(server.base_url, r) for r in rates]
for r, s in zip(rates, by_rate):
    print(f"{r:5.2f} req/s ({r / capacity:4.2f} x capacity): p99 TTFT "
          f"{s['ttft_ms']['p99']:6.0f} ms, mean ITL {s['itl_ms']['mean']:4.0f} ms, "
          f"{s['output_throughput']:5.1f} output tok/s")
server.stop()

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
load = [r / capacity for r in rates]
a.plot(load, [s["ttft_ms"]["p99"] / 1000 for s in by_rate], "o-")
a.set(xscale="log", xlabel="offered load (request rate / capacity)", ylabel="p99 TTFT (s)",
      title="TTFT grows once requests queue")
b.plot(load, [s["output_throughput"] for s in by_rate], "o-", label="measured")
b.axhline(burst["output_throughput"], color="grey", ls=":", label="warm-up burst")
b.set(xscale="log", xlabel="offered load (request rate / capacity)",
      ylabel="output tokens / s", title="throughput flattens at capacity")
b.legend()
for ax in (a, b):
    ax.axvline(1.0, color="grey", lw=0.8)
fig.tight_layout()
fig.savefig(figure_path("08_serving_rate.png"), dpi=110)

# %% [markdown]
# **Figure 08.1.** p99 time to first token (left) and output throughput (right)
# against the offered load, in units of the capacity the burst measured (the
# vertical line). Look at the left first: below and near the capacity, TTFT stays
# near one prefill plus a little queueing; past it, requests arrive faster than
# they finish and wait in the queue, and p99 TTFT climbs steeply. On the right,
# below the capacity the server finishes exactly what it is offered, so
# throughput grows with the load; on a quiet machine it then levels off near the
# burst's rate (dotted), the most this server can do. On a shared machine whose
# load changes during the run, the points past the line can rise above the
# dotted line: then the machine got faster after the burst, not the server. With
# 12 requests per pass every point is noisy; the shape is the lesson.
#
# "The highest rate that keeps p99 TTFT under 2 s" is how a server's capacity is
# quoted (``minivllm bench serve --sweep ...`` finds it for you).
#
# 3. Chunked prefill: the token budget per step
# ---------------------------------------------
#
# Every engine step computes at most ``max_num_batched_tokens`` tokens: first
# one decode token for each running request, then as much of the waiting
# prompts as fits. With a big budget a long prompt is prefilled in one step,
# and every running request waits for that step: an ITL spike. With a small
# budget the prompt is cut into chunks spread over several steps: each step
# stays short, but the new request needs several steps before its first token.
#
# To see it, the prompts must be long next to a decode step: 6 requests with
# prompts of 192-320 tokens and 24 output tokens, arriving at half the capacity
# measured above, on a server warmed up by two requests first.

# %%
long_prompts, long_outs = make_workload(6, (192, 320), (24, 24), vocab_size, seed=1)
budgets = [32, 128, 512]
by_budget = []
for budget in budgets:
    server, _ = start_server(max_num_batched_tokens=budget, max_num_seqs=8)
    asyncio.run(run_pass(server.base_url, MODEL, long_prompts[:2], long_outs[:2], math.inf,
                         burstiness=1.0, max_concurrency=None, seed=0))  # warm-up
    by_budget.append(asyncio.run(run_pass(server.base_url, MODEL, long_prompts, long_outs,
                                          capacity / 2, burstiness=1.0, max_concurrency=None,
                                          seed=1)))
    server.stop()
    s = by_budget[-1]
    print(f"budget {budget:>3}: mean TTFT {s['ttft_ms']['mean']:6.0f} ms, p99 ITL "
          f"{s['itl_ms']['p99']:5.0f} ms, mean ITL {s['itl_ms']['mean']:5.0f} ms")

# %%
fig, ax = plt.subplots(figsize=(5.5, 4))
for budget, s in zip(budgets, by_budget):
    ax.scatter(s["itl_ms"]["p99"], s["ttft_ms"]["mean"], s=60)
    ax.annotate(f"max_num_batched_tokens={budget}", (s["itl_ms"]["p99"], s["ttft_ms"]["mean"]),
                textcoords="offset points", xytext=(5, 5), fontsize=8)
ax.set(xlabel="p99 inter-token latency (ms)", ylabel="mean TTFT (ms)",
       title="chunked prefill: ITL against TTFT")
fig.tight_layout()
fig.savefig(figure_path("08_serving_chunked_prefill.png"), dpi=110)

# %% [markdown]
# **Figure 08.2.** For each token budget, the mean time to first token against the
# p99 gap between two tokens of a running request. Look at where each budget
# lands: a small budget cuts the long prompts into many chunks, so the first
# token comes several steps later (higher TTFT) while no step grows long; a big
# budget prefills a prompt in one step, which is fast for that request but
# stalls every running request for that step (a higher p99 ITL on a machine
# where prefill costs much more than a decode). On a busy CPU the ITL axis
# carries scheduler noise too; the TTFT ordering is the robust part. vLLM's
# default favours throughput and TTFT; latency-sensitive deployments lower the
# budget.
#
# Everything here is also available without Python: ``minivllm serve``, then
# ``minivllm bench serve --base-url http://127.0.0.1:8000 --sweep 0.5,1,2``.
# The server's ``/metrics`` exposes the same quantities as Prometheus
# histograms (``vllm:time_to_first_token_seconds``,
# ``vllm:inter_token_latency_seconds``).

# %% [markdown]
# 4. The server's own view: vLLM's dashboard from ``/metrics``
# ------------------------------------------------------------
#
# The benchmark timed requests from the client's side. A deployed server is watched
# from the inside instead: Prometheus scrapes its ``/metrics`` every few seconds and
# Grafana draws vLLM's dashboard from the series. minivllm's metrics carry vLLM's
# names (``vllm:e2e_request_latency_seconds``, ``vllm:num_requests_waiting``,
# ``vllm:kv_cache_usage_perc`` ...), so the dashboard's queries work unchanged. Here
# we play Prometheus: scrape every 0.25 s while the 12 requests of section 2 arrive
# at twice the capacity (so a queue forms), and evaluate the main panels' queries
# ourselves.
#
# A histogram on ``/metrics`` is cumulative counters, one per bucket
# (``..._bucket{le="0.5"}``: how many observations were <= 0.5 s so far). A latency
# panel is ``histogram_quantile(0.99, rate(..._bucket[window]))``: each bucket's
# increase over the last window, and the quantile interpolated linearly inside the
# bucket where it falls. A throughput panel is ``rate(counter[window])``; the
# scheduler and cache panels plot gauges as they are.

# %%
WINDOW = 3.0  # seconds: the dashboard's rate window


def parse(text: str) -> dict:
    """One scrape: ``{(sample name, le): value}``, summed over the other labels."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("le"))
            out[key] = out.get(key, 0.0) + sample.value
    return out


async def load_and_scrape(url: str, rate: float, every: float = 0.25):
    """Run section 2's workload at ``rate`` while scraping ``/metrics``, and 0.5 s after."""
    scrapes = []  # (seconds since the start, parsed scrape)
    async with httpx.AsyncClient() as http:
        load = asyncio.create_task(run_pass(url, MODEL, prompts, out_lens, rate,
                                            burstiness=1.0, max_concurrency=None, seed=2))
        start, done_at = time.perf_counter(), None
        while done_at is None or time.perf_counter() - done_at < 0.5:
            text = (await http.get(f"{url}/metrics")).text
            scrapes.append((time.perf_counter() - start, parse(text)))
            if done_at is None and load.done():
                done_at = time.perf_counter()
            await asyncio.sleep(every)
    return scrapes, load.result()


def increase(scrapes, key) -> tuple[np.ndarray, np.ndarray]:
    """Times, and each counter's increase over the WINDOW before them (and its length)."""
    t = np.array([s[0] for s in scrapes])
    v = np.array([s[1].get(key, 0.0) for s in scrapes])
    first = np.searchsorted(t, t - WINDOW)  # the oldest scrape inside each window
    return v - v[first], t - t[first]


def rate_of(scrapes, name: str) -> np.ndarray:
    """Prometheus' ``rate(name[WINDOW])``: per second (NaN before a window has two points)."""
    delta, span = increase(scrapes, (name, None))
    return np.where(span > 0, delta / np.maximum(span, 1e-9), np.nan)


def histogram_quantile(q: float, scrapes, name: str) -> np.ndarray:
    """Prometheus' ``histogram_quantile(q, rate(name_bucket[WINDOW]))`` at every scrape
    (NaN where the window saw no observation: the gaps in a Grafana panel)."""
    les = sorted({le for _, s in scrapes for (n, le) in s if n == f"{name}_bucket"},
                 key=float)
    bounds = np.array([float(le) for le in les])
    counts = np.stack([increase(scrapes, (f"{name}_bucket", le))[0] for le in les], axis=1)
    out = np.full(len(scrapes), np.nan)
    for i, cumulative in enumerate(counts):  # (num_buckets,) observations <= each bound
        if cumulative[-1] <= 0:
            continue
        rank = q * cumulative[-1]
        b = int(np.searchsorted(cumulative, rank))  # the bucket the rank falls in
        if b == len(bounds) - 1:  # the +Inf bucket: its lower bound, as Prometheus does
            out[i] = bounds[-2]
            continue
        lo, below = (bounds[b - 1], cumulative[b - 1]) if b > 0 else (0.0, 0.0)
        out[i] = lo + (bounds[b] - lo) * (rank - below) / (cumulative[b] - below)
    return out


server, _ = start_server(max_num_batched_tokens=512, max_num_seqs=8)
asyncio.run(run_pass(server.base_url, MODEL, prompts[:1], [4], math.inf, burstiness=1.0,
                     max_concurrency=None, seed=0))  # warm-up
scrapes, summary = asyncio.run(load_and_scrape(server.base_url, 2 * capacity))
server.stop()
print(f"{len(scrapes)} scrapes over {scrapes[-1][0]:.1f} s; the client measured p99 TTFT "
      f"{summary['ttft_ms']['p99']:.0f} ms, p99 E2E {summary['e2el_ms']['p99']:.0f} ms")

# %%
t = np.array([s[0] for s in scrapes])
gauge = {name: np.array([s[1].get((f"vllm:{name}", None), 0.0) for s in scrapes])
         for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True)
latency_panels = [("E2E request latency", "vllm:e2e_request_latency_seconds"),
                  ("time to first token", "vllm:time_to_first_token_seconds"),
                  ("inter-token latency", "vllm:inter_token_latency_seconds")]
for ax, (title, name) in zip(axes[0], latency_panels):
    for q in (0.99, 0.9, 0.5):
        ax.plot(t, histogram_quantile(q, scrapes, name), label=f"P{round(q * 100)}")
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: nothing in the window
        mean = rate_of(scrapes, f"{name}_sum") / rate_of(scrapes, f"{name}_count")
    ax.plot(t, mean, "k--", lw=1, label="mean")
    ax.set(title=title, ylabel="seconds")
    ax.legend(fontsize=8)
a, b, c = axes[1]
a.plot(t, rate_of(scrapes, "vllm:prompt_tokens_total"), label="prompt tokens")
a.plot(t, rate_of(scrapes, "vllm:generation_tokens_total"), label="generation tokens")
a.set(title="token throughput", ylabel="tokens / s")
a.legend(fontsize=8)
b.step(t, gauge["num_requests_running"], ".-", where="post", ms=3, label="running")
b.step(t, gauge["num_requests_waiting"], ".-", where="post", ms=3, label="waiting")
b.set(title="scheduler state", ylabel="requests")
b.legend(fontsize=8)
c.plot(t, 100 * gauge["kv_cache_usage_perc"], ".-", ms=3)
c.set(title="KV cache usage", ylabel="% of blocks")
for ax in axes[1]:
    ax.set_xlabel("seconds since the load began")
fig.tight_layout()
fig.savefig(figure_path("08_serving_dashboard.png"), dpi=110)

# %% [markdown]
# **Figure 08.3.** The main panels of vLLM's Grafana dashboard, computed from
# ``/metrics`` scraped every 0.25 s during one short run (12 requests offered at
# twice the capacity), with a 3 s rate window. Top: the P50/P90/P99 and mean of
# end-to-end latency, time to first token and inter-token latency over the last
# window (a gap: nothing finished, or started, in it). Bottom: prompt and
# generation tokens per second, requests running and waiting (a dot per scrape),
# and the share of KV blocks in use.
#
# What it shows on a CPU: ``running`` never passes ``max_num_seqs=8``; the requests
# beyond it wait (``waiting`` above zero), and the TTFT quantiles of the window
# in which they are admitted climb: their first token waited for a free slot, not
# for its prefill. Each admission is a spike of prompt tokens per second (a
# prefill), while generation runs at a few tens of tokens per second, the CPU's
# decode rate. The KV-cache panel stays at a few percent: a dozen short requests
# hold little of a pool sized for 1024-token sequences, so here the CPU's compute,
# not KV memory, is the limit (on a GPU serving long prompts it is the other way
# round, and preemptions would show). The quantiles are coarse: a histogram only
# knows its buckets (vLLM's TTFT buckets are 5, 7.5, 10, 20 s ... up there) and
# ``histogram_quantile`` interpolates inside one, so the panel's P99 can sit well
# above the client's own p99 printed above. The gauges and counters move only when
# an engine step ends: on a busy machine one step can take seconds, which shows as
# flat stretches in every panel (the dots: the scrapes kept coming) and as spikes of
# inter-token latency.

# %% [markdown]
# 5 · A soak: does the latency hold?
# -----------------------------------
#
# A short run shows a server's speed; a long one shows whether it keeps it: a leak
# (KV blocks never freed, memory that only grows) shows only with time. ``minivllm
# bench serve --soak 600`` measures capacity (a burst of requests at once), then
# sends Poisson arrivals at 80% of it for ten minutes, with one client in ten hanging
# up mid-stream, ``n=2`` and regex-constrained requests in the mix, and reports
# latency and memory per window. Here is the same code for 20 seconds.

# %%
from minivllm.bench._soak import plot_soak, run_soak  # noqa: E402

llm = LLM(MODEL, device="cpu", max_model_len=1024, backend="auto", max_num_seqs=16)
server = ServerThread.start(AsyncLLM(llm.llm_engine), MODEL)
try:
    soak = run_soak(llm.llm_engine, server.base_url, MODEL, llm.llm_engine.vocab_size, 20.0,
                    window_s=4.0, input_len=(16, 64), output_len=(8, 24), capacity_requests=8)
finally:
    server.stop()
print(f"capacity {soak['capacity']:.2f} req/s; soaked at {soak['rate']:.2f} req/s: "
      f"{soak['num_requests']} requests, {soak['hung_up']} hung up, "
      f"{soak['num_errors']} errors, {soak['leaked_blocks']} KV blocks left in use")
for target, met in soak["targets"].items():
    print(f"  [{'met' if met else 'MISSED'}] {target}")
fig, (ax_lat, ax_rss) = plt.subplots(1, 2, figsize=(10, 3.6))
plot_soak(soak, ax_lat, ax_rss)
fig.tight_layout()
fig.savefig(figure_path("08_serving_soak.png"), dpi=110)

# %% [markdown]
# **Figure 08.4.** Twenty seconds at 80% of the capacity measured just before, in
# windows of 4 s. Left: the p50 and p99 time to first token and inter-token latency
# of the requests that arrived in each window (log scale). Right: the server's
# resident memory at the end of each window, as a change from the first window after
# warm-up, between the dashed lines of the ±5% target. Look for a trend, not a level:
# below capacity the queue drains between bursts, so the lines wander inside a band (a
# window where Poisson arrivals bunched up has a higher p99) instead of climbing, and
# the memory stays inside its band after the first window. On a busy
# machine one slow step lifts a whole window. The lines printed above say which of
# the soak's targets this short run met; the ten-minute run
# (``minivllm bench serve --soak 600``) is the one whose figures count.

# %% [markdown]
# What you built
# --------------
#
# An OpenAI-compatible server around ``AsyncLLM``, a reply streamed through the ``openai``
# client, a request-rate sweep and a token-budget sweep that show what a server trades,
# the server's own dashboard drawn from its ``/metrics``, and a soak that checks the
# latency holds.

# %% [markdown]
# The test command
# ----------------
#
# The server is tested as a real subprocess with the official ``openai`` client:
# streamed text equals non-streamed text equals ``LLM.generate``, usage is exact,
# bad input gets a 4xx, a disconnect frees the KV blocks, a dead
# tensor-parallel worker becomes an error:
#
# .. code-block:: bash
#
#    pytest tests/test_async_llm.py tests/test_server.py --backend=ref
#    pytest tests/test_async_llm.py tests/test_server.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# No task grades the server itself: it serves whatever components your student
# package provides. Serve your own scheduler and KV cache manager (task 4
# ``kv_cache_manager``: :doc:`/course/04_kv_cache_manager`, task 5 ``scheduler``:
# :doc:`/course/05_scheduler`) and watch the same curves:
#
# .. code-block:: bash
#
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task kv_cache_manager --task scheduler
#    PYTHONPATH=hw minivllm serve --backend minivllm_student
