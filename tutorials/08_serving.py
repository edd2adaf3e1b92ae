# %% [markdown]
# # 08 · Serving: latency against throughput
#
# Offline, an engine is judged by one number: tokens per second. A server has
# users waiting, and two more numbers matter:
#
# - **TTFT**, time to the first token: how long a user stares at nothing
#   (queueing + the prefill of the prompt);
# - **ITL**, inter-token latency: how fast the words then appear (one decode
#   step of the whole batch per token).
#
# You will learn:
#
# 1. how `minivllm serve` turns the step-by-step `LLMEngine` into an online
#    server (`AsyncLLM`: one engine thread, an asyncio queue per request), and
#    how to stream a reply from it with the `openai` client;
# 2. what happens to TTFT and throughput as the **request rate** grows: below
#    capacity TTFT is just the prefill; above it, requests queue and TTFT
#    explodes while throughput flattens;
# 3. how **chunked prefill** (`max_num_batched_tokens`) trades the two
#    latencies: a small token budget splits long prompts over several steps, so
#    the running requests' decode steps stay short (low ITL) but new requests
#    wait longer for their first token (higher TTFT).
#
# Everything runs on a CPU with SmolLM2-135M and a deliberately small workload,
# so the numbers are noisy; the shapes of the curves are the lesson.

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


def start_server(max_num_batched_tokens: int) -> tuple[ServerThread, int]:
    """Load the model, wrap its engine in AsyncLLM and serve it on a free local port.

    Returns the running server and the model's vocabulary size."""
    llm = LLM(MODEL, device="cpu", max_model_len=1024, backend="auto",
              max_num_batched_tokens=max_num_batched_tokens)
    return ServerThread.start(AsyncLLM(llm.llm_engine), MODEL), llm.llm_engine.vocab_size


# %% [markdown]
# ## 1. Start the server and stream a reply
#
# `ServerThread` runs the same FastAPI app as `minivllm serve` (the command
# line), in a background thread of this process. Any OpenAI client can talk
# to it; `stream=True` gets Server-Sent Events, one chunk per engine step.

# %%
server, vocab_size = start_server(max_num_batched_tokens=512)
client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
stream = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "What is a KV cache? One sentence."}],
    max_tokens=40, temperature=0, stream=True)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

# %% [markdown]
# ## 2. Sweep the request rate
#
# `minivllm bench serve` sends requests with random (Poisson) arrival gaps at
# a given rate and measures every token's arrival time. We reuse its
# `run_pass` with a short workload: prompts of 64-192 tokens, 24 output tokens.

# %%
N = 10
prompts, out_lens = make_workload(N, (64, 192), (24, 24), vocab_size, seed=0)


def measure(url: str, rate: float) -> dict:
    return asyncio.run(run_pass(url, MODEL, prompts, out_lens, rate, burstiness=1.0,
                                max_concurrency=None, seed=0))


rates = [0.5, 2.0, 8.0]
by_rate = [measure(server.base_url, r) for r in rates]
for r, s in zip(rates, by_rate):
    print(f"{r:>4} req/s: p99 TTFT {s['ttft_ms']['p99']:7.0f} ms, mean ITL "
          f"{s['itl_ms']['mean']:5.0f} ms, {s['output_throughput']:6.1f} output tok/s")
server.stop()

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
a.plot(rates, [s["ttft_ms"]["p99"] / 1000 for s in by_rate], "o-")
a.set(xscale="log", xlabel="request rate (req/s)", ylabel="p99 TTFT (s)",
      title="TTFT grows once requests queue")
b.plot(rates, [s["output_throughput"] for s in by_rate], "o-")
b.set(xscale="log", xlabel="request rate (req/s)", ylabel="output tokens / s",
      title="throughput saturates")
fig.tight_layout()
fig.savefig(figure_path("08_serving_rate.png"), dpi=110)

# %% [markdown]
# At a low rate each request finds the engine idle: TTFT is one prefill and
# throughput is simply the offered load. As the rate grows, batches get bigger
# (more tokens per step, so more tokens per second), until the engine is
# saturated: from then on new requests wait in the queue, and p99 TTFT rises
# steeply while throughput stops growing. "The highest rate that keeps p99
# TTFT under 2 s" is how a server's capacity is quoted
# (`minivllm bench serve --sweep ...` finds it for you).
#
# ## 3. Chunked prefill: the token budget per step
#
# Every engine step computes at most `max_num_batched_tokens` tokens: first
# one decode token for each running request, then as much of the waiting
# prompts as fits. With a big budget a 190-token prompt is prefilled in one
# step, and every running request waits for that step: an ITL spike. With a
# small budget the prompt is cut into chunks spread over several steps: each
# step stays short, but the new request needs several steps before its first
# token.

# %%
budgets = [32, 128, 512]
by_budget = []
for budget in budgets:
    server, _ = start_server(max_num_batched_tokens=budget)
    measure(server.base_url, math.inf)  # warm-up pass
    by_budget.append(measure(server.base_url, 4.0))
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
       title="chunked prefill: ITL against TTFT at 4 req/s")
fig.tight_layout()
fig.savefig(figure_path("08_serving_chunked_prefill.png"), dpi=110)

# %% [markdown]
# Things to notice:
#
# - The smallest budget keeps the worst inter-token gap lowest (a decode step
#   never waits for a long prefill) but the first token comes later: a prompt
#   of ~190 tokens needs ~6 steps of 32.
# - The largest budget gives the fastest first token but the worst ITL spikes.
#   vLLM's default favours throughput and TTFT; latency-sensitive deployments
#   lower the budget.
# - Everything here is also available without Python: `minivllm serve`, then
#   `minivllm bench serve --base-url http://127.0.0.1:8000 --sweep 0.5,1,2`.
#   The server's `/metrics` exposes the same quantities as Prometheus
#   histograms (`minivllm:time_to_first_token_seconds`,
#   `minivllm:inter_token_latency_seconds`).
#
# ## Check it yourself
#
# The server is tested as a real subprocess with the official `openai` client:
# streamed text equals non-streamed text equals `LLM.generate`, usage is exact,
# bad input gets a 4xx, a disconnect frees the KV blocks, a dead
# tensor-parallel worker becomes an error:
#
# ```bash
# pytest tests/test_async_llm.py tests/test_server.py --backend=ref
# pytest tests/test_async_llm.py tests/test_server.py --backend=fast
# ```
