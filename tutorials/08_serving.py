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
   wait longer for their first token (higher TTFT).

Everything runs on a CPU with SmolLM2-135M and a deliberately small workload,
so the numbers are noisy; the shapes of the curves are the lesson.
"""

# %%
import asyncio
import math

import matplotlib

matplotlib.use("Agg")  # no window: the figures are saved as PNGs
import matplotlib.pyplot as plt
import openai
from _figures import figure_path  # tutorials/figures/, ignored by git

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
# What you built
# --------------
#
# An OpenAI-compatible server around ``AsyncLLM``, a reply streamed through the ``openai``
# client, a request-rate sweep and a token-budget sweep that show what a server trades.

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
