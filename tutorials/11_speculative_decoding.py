"""
11 · Speculative decoding: several tokens per forward pass
==========================================================

At batch 1 every generated token costs one full forward pass, and that pass
reads every weight of the model once (tutorial 09). Speculative decoding
spends one pass on several tokens: a cheap *proposer* guesses ``k`` tokens,
the target model scores all ``k + 1`` prefixes in **one** pass, and a
*rejection sampler* keeps a prefix of the guesses plus one token of its own.
The output is distributed exactly as plain decoding's (Leviathan et al., arXiv
2211.17192). This tutorial:

1. measures why one pass can verify ``k`` tokens: the cost of a SmolLM2
   forward pass at batch 1 with 1 against ``k + 1`` query tokens;
2. states the acceptance rule, and checks empirically with the
   ``rejection_sampler`` component that it keeps the target's distribution
   even when the drafts disagree badly;
3. turns the measured pass costs into the speed-up against the acceptance
   rate ``α`` and ``k``, beside the expected-tokens formula
   ``(1 − α^(k+1)) / (1 − α)``, and measures ``α`` for self-speculation
   (the draft is SmolLM2's own first ``L`` layers, LayerSkip-style).

The rule, its proof and the engine integration are in :doc:`/speculative_decoding`.
It runs in about a minute on a laptop CPU (float32; the first run builds the C++ kernels).
"""

# %%
import time

import matplotlib

matplotlib.use("Agg")  # no window: the figures are saved as PNGs
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import SamplingParams, backend
from minivllm.bench.quality import TEXT
from minivllm.engine.config import WorkerConfig
from minivllm.metadata import AttentionMetadata, StepInput
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.spec_decode.draft_model import DraftModelProposer
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.worker.worker import Worker

torch.manual_seed(0)
# One thread: on a shared CPU a multi-threaded matmul of a few rows waits for its second
# thread (milliseconds), swamping the pass costs measured here.
torch.set_num_threads(1)
print("threads:", torch.get_num_threads())


def best_of(fn, repeats=7):
    """The fastest of a few runs, in seconds (the least disturbed by other work)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# %% [markdown]
# 1 · One pass, many query tokens
# -------------------------------
#
# We load SmolLM2-135M (float32) into a :class:`~minivllm.worker.worker.Worker`,
# give one sequence a 128-token context in the paged KV cache (a paragraph of
# English), and then time one
# forward pass over ``q`` new query tokens at positions ``128 .. 128 + q − 1``,
# with logits for every one of them: exactly what verifying ``k = q − 1``
# drafts costs. (Each timing rewrites the same positions, so the context stays
# 128 tokens.)

# %%
BLOCK, CONTEXT = 16, 128
worker = Worker(WorkerConfig("smollm2", torch.float32, "cpu"))
worker.init_kv_cache(num_blocks=16, block_size=BLOCK, max_num_reqs=1)
V = worker.model.config.vocab_size
gen = torch.Generator().manual_seed(0)
context = worker.tokenizer.encode(TEXT)[:CONTEXT]


def step_input(first: int, tokens: list[int], new_blocks=()) -> StepInput:
    """One sequence "A" computing ``tokens`` at positions ``first ..``, logits on every row."""
    n = len(tokens)
    return StepInput(req_ids=("A",), new_req_ids=frozenset({"A"} if new_blocks else ()),
                     new_block_ids=(tuple(new_blocks),), removed_req_ids=(),
                     query_lens=(n,), seq_lens=(first + n,),
                     input_ids=torch.tensor(tokens), positions=torch.arange(first, first + n),
                     logits_indices=torch.arange(n))


worker.execute_model(step_input(0, context, new_blocks=range(16)))  # the prefill: 16 blocks
query_lens = [1, 2, 3, 4, 6, 8, 12]
pass_ms = {}
for q in query_lens:
    inp = step_input(CONTEXT, context[:q])
    worker.execute_model(inp)  # warm up this shape
    pass_ms[q] = 1e3 * best_of(lambda inp=inp: worker.execute_model(inp), 5)
    print(f"q = {q:2d} query tokens: {pass_ms[q]:6.1f} ms  ({pass_ms[q] / pass_ms[1]:.2f}x q = 1)")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.plot(query_lens, [pass_ms[q] for q in query_lens], "o-", label="measured pass")
ax.plot(query_lens, [pass_ms[1] * q for q in query_lens], ":", color="gray",
        label="q separate 1-token passes")
ax.set_xlabel("query tokens in one pass (k + 1)")
ax.set_ylabel("ms per forward pass")
ax.set_ylim(0, pass_ms[1] * 6)
ax.set_title("SmolLM2-135M, batch 1, float32, 128-token context")
ax.legend()
fig.tight_layout()
fig.savefig(figure_path("11_pass_cost.png"), dpi=120)

# %% [markdown]
# **Figure 11.1.** The time of one forward pass of SmolLM2-135M at batch 1
# against the number of query tokens it scores (solid), beside the cost of
# scoring them in as many one-token passes (dotted). Look at how far the solid
# line stays below the dotted one: every query token reads the same weights, so
# a pass of ``k + 1`` tokens costs far less than ``k + 1`` passes (the ratios
# are printed above). It is not free on a CPU, though. On the 2-core
# development machine (one thread, load average about 2) a 2-token pass cost
# 1.03 times a 1-token one, 4 tokens 1.3 times and 12 tokens about 2 times.
# Up to 16 rows every linear layer runs the C++ small-M GEMV
# (``torch.ops.minivllm.linear_small_m``), which streams each weight once for
# all the rows; what grows with the rows is the arithmetic, the attention and
# the LM head's logits. (Before that kernel took float32 weights, torch's GEMM
# for 2 to 16 rows packed the weight first and a 2-token pass cost 1.6 to 2.2
# times a 1-token one.) The smaller that ratio, the more a good guess saves.

# %% [markdown]
# 2 · The acceptance rule
# -----------------------
#
# For each draft ``x_j`` in turn, with ``p`` the target's distribution at that
# position and ``q`` the distribution the draft was sampled from: accept
# ``x_j`` with probability ``min(1, p(x_j) / q(x_j))``; at the first rejection
# emit one token from ``norm(max(p − q, 0))`` and stop; if all ``k`` are
# accepted, emit a bonus token from ``p``. A token ``t`` comes out either as an
# accepted draft, with probability ``min(p(t), q(t))``, or as the recovered
# token, with probability ``P(reject) · max(p(t) − q(t), 0) / Σ max(p − q, 0)
# = max(p(t) − q(t), 0)``; the two add up to ``p(t)``. The full proof, and the
# greedy and n-gram special cases, are in :doc:`/speculative_decoding`.
#
# An empirical check: one position, a vocabulary of 8, a target ``p`` and a draft
# ``q`` that puts most of its mass where ``p`` puts the least. 20000 requests
# each get one draft sampled from ``q``, and the engine's ``rejection_sampler``
# decides. The first emitted token must be distributed as ``p``, not ``q``.

# %%
rs = backend.get("rejection_sampler")
p = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])
q = torch.tensor([0.02, 0.03, 0.05, 0.05, 0.10, 0.15, 0.25, 0.35])  # disagrees badly
N, K = 20000, 1
drafts = torch.multinomial(q, N, replacement=True, generator=gen)  # (N,) from q
spec = SpecDecodeMetadata.make([[int(x)] for x in drafts], 8)
target_logits = p.log().repeat(N * (K + 1), 1)  # (N (k + 1), V): the same p everywhere
reqs = [Request(f"r{i}", [0], SamplingParams(temperature=1.0)) for i in range(N)]
md = SamplingMetadata.from_requests(reqs, 8, "cpu", torch.Generator().manual_seed(1), {})
out = rs.rejection_sample(target_logits, spec, q.repeat(N, 1), md)
first = out.output_token_ids[:, 0]
emitted = torch.bincount(first, minlength=8).float() / N
accept_rate = float(out.num_accepted_tokens.float().mean())
overlap = float(torch.minimum(p, q).sum())
print(f"acceptance rate {accept_rate:.3f} (theory: sum min(p, q) = {overlap:.3f})")
print("largest |emitted - p|:", f"{float((emitted - p).abs().max()):.4f}",
      f"(one standard error is about {float((p * (1 - p) / N).sqrt().max()):.4f})")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.5))
width = 0.27
ids = torch.arange(8)
ax.bar(ids - width, q, width, label="draft q", color="tab:orange")
ax.bar(ids, p, width, label="target p", color="tab:blue")
ax.bar(ids + width, emitted, width, label="emitted (20000 requests)", color="tab:green")
ax.set_xlabel("token id")
ax.set_ylabel("probability")
ax.set_title(f"one draft per request, acceptance rate {accept_rate:.2f}")
ax.legend()
fig.tight_layout()
fig.savefig(figure_path("11_rejection_rule.png"), dpi=120)

# %% [markdown]
# **Figure 11.2.** A draft distribution ``q`` (orange) that disagrees badly with
# the target ``p`` (blue), and the distribution of the token the rejection
# sampler emits (green). Look at the green bars: they follow the blue ones, not
# the orange ones. Most drafts are rejected (the acceptance rate is
# ``Σ min(p, q)``, printed above), and the recovered tokens fill exactly the
# mass the accepted drafts left out. A bad proposer costs speed, never
# correctness. (``tests/test_rejection_sampler.py`` does this with a chi-square
# test at every position, the bonus token included.)

# %% [markdown]
# 3 · The speed-up against α and k
# --------------------------------
#
# If each draft is accepted with probability ``α``, a step with ``k`` drafts
# emits ``1 + α + ... + α^k = (1 − α^(k+1)) / (1 − α)`` tokens on average. It
# costs one verification pass of ``k + 1`` tokens (measured in section 1) plus
# the proposer. Against plain decoding (one token per 1-token pass):
#
# .. code-block:: text
#
#    speed-up = (1 − α^(k+1)) / (1 − α)  /  (T(k + 1) + k · T_draft) · T(1)
#
# Two proposers: **n-gram** prompt lookup is nearly free (``T_draft ≈ 0``), so
# its speed-up approaches the formula as the pass cost ratio approaches 1.
# **Self-speculation** drafts with the target's own first ``L`` of 30 layers,
# its final norm and LM head (``speculative_config={"method": "draft_model",
# "num_draft_layers": L}``). Its drafts write their K/V into the target's own
# cache (zero extra memory). We measure what one draft step costs, and how often
# its greedy guess equals the full model's greedy token along a greedy
# continuation (for greedy decoding that agreement is ``α``).

# %%
prompt = list(context)
seq = list(prompt)
for _ in range(48):  # the target's own greedy continuation, one token a pass
    logits = worker.execute_model(step_input(len(seq) - 1, [seq[-1]])).logits
    seq.append(int(logits[-1].argmax()))
greedy_cont = seq[len(prompt):]


def early_exit_agreement(layers: int) -> float:
    """How often the first ``layers`` layers' argmax equals the full model's, teacher-forced."""
    view = worker.model.first_layers(layers)
    tokens = seq[len(prompt) - 1 : -1]  # the inputs whose next tokens are greedy_cont
    first = len(prompt) - 1
    md = AttentionMetadata.build(
        query_lens=[len(tokens)], seq_lens=[first + len(tokens)],
        block_tables=worker.block_tables.block_table_tensor(["A"]),
        slot_mapping=worker.block_tables.slot_mapping(["A"], [first], [len(tokens)]))
    with torch.inference_mode():
        hidden = view(torch.tensor(tokens), torch.arange(first, first + len(tokens)),
                      worker.kv_caches[:layers], md)
        guess = view.compute_logits(hidden).argmax(-1).tolist()
    return sum(g == t for g, t in zip(guess, greedy_cont)) / len(greedy_cont)


def draft_step_ms(layers: int, k: int = 3) -> float:
    """Milliseconds per draft token of a real proposer run (k decode steps of L layers)."""
    proposer = DraftModelProposer.self_speculation(worker, layers)
    req = Request("A", seq[:CONTEXT + 1], SamplingParams(temperature=0.0))
    proposer.propose([req], [k])  # warm up
    return 1e3 * best_of(lambda: proposer.propose([req], [k]), 3) / k


layer_counts = [8, 15, 22, 26, 28]
alpha_self = {L: early_exit_agreement(L) for L in layer_counts}
draft_ms = {L: draft_step_ms(L) for L in layer_counts}
for L in layer_counts:
    print(f"L = {L:2d} layers: agrees with the full model {alpha_self[L]:.0%} of the time, "
          f"a draft step costs {draft_ms[L]:.1f} ms ({draft_ms[L] / pass_ms[1]:.2f}x a full pass)")

# %%
def expected_tokens(alpha: float, k: int) -> float:
    """``(1 − α^(k+1)) / (1 − α)``: drafts accepted in a row, plus the one extra token."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, k: int, draft_cost_ms: float) -> float:
    """The model above: tokens per step over the step's cost in 1-token passes."""
    return expected_tokens(alpha, k) * pass_ms[1] / (pass_ms[k + 1] + k * draft_cost_ms)


def alpha_for(mean_tokens: float, k: int) -> float:
    """The α at which the formula gives ``mean_tokens`` per step (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < mean_tokens else (lo, mid)
    return lo


# %% [markdown]
# Now the engine itself, end to end. SmolLM2 is asked to repeat a passage word
# for word: an *input-grounded* request, where n-gram lookup finds the
# continuation in the prompt. Greedy, batch 1, 32 new tokens, for plain
# decoding, n-gram lookup with ``k`` of 1, 3 and 5, and self-speculation with
# ``L = 28``, ``k = 3``. Decode speed is the time of 33 tokens minus that of
# 1 (the prefill). From the engine's counters (``StepStats``) we take the mean
# acceptance length, ``1 + accepted / verifications`` (vLLM's definition, the
# extra token counted), and the ``α`` at which the formula gives that length.
# The per-request back-off (``minivllm/spec_decode/backoff.py``) is on, as it
# is by default.

# %%
from minivllm import LLM  # noqa: E402  (the engine only from here on)

passage = TEXT[:480]


def engine_run(llm, prompt_ids: list[int], n: int):
    """Seconds, ``[verifications, drafts, accepted]`` and the tokens of one greedy request."""
    engine = llm.llm_engine
    engine.add_request(None, prompt_ids, SamplingParams(temperature=0.0, max_tokens=n,
                                                        ignore_eos=True))
    counts, tokens = [0, 0, 0], None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        counts[0] += stats.num_drafts
        counts[1] += stats.num_draft_tokens
        counts[2] += stats.num_accepted_tokens
        tokens = next((o.outputs[0].token_ids for o in outputs if o.finished), tokens)
    return time.perf_counter() - start, counts, tokens


runs = [("plain", None, 0)]
runs += [(f"n-gram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 5}, k)
         for k in (1, 3, 5)]
runs += [("self-spec L=28 k=3", {"method": "draft_model", "num_speculative_tokens": 3,
                                 "num_draft_layers": 28}, 3)]
measured = {}
for name, config, k in runs:
    llm = LLM("smollm2", dtype="float32", max_num_seqs=1, kv_cache_memory=64 << 20,
              max_model_len=1024, speculative_config=config)  # the pool holds 1456 tokens
    chat = [{"role": "user", "content": "Repeat this passage exactly, word for word:\n\n"
             + passage}]
    prompt_ids = llm.get_tokenizer().apply_chat_template(chat, add_generation_prompt=True,
                                                         tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    engine_run(llm, prompt_ids, 2)  # warm up
    t1 = min(engine_run(llm, prompt_ids, 1)[0] for _ in range(2))
    t33, counts, tokens = engine_run(llm, prompt_ids, 33)
    llm.shutdown()
    tok_s = 32 / (t33 - t1)
    mean_len = 1 + counts[2] / counts[0] if counts[0] else 1.0
    measured[name] = dict(k=k, tok_s=tok_s, counts=counts, tokens=tokens,
                          alpha=alpha_for(mean_len, k) if k else None, mean_len=mean_len)
plain = measured["plain"]
for name, m in measured.items():
    extra = "" if not m["k"] else (
        f", {m['counts'][2]}/{m['counts'][1]} drafts accepted, mean acceptance length "
        f"{m['mean_len']:.2f} (α ≈ {m['alpha']:.2f})")
    print(f"{name:>19}: {m['tok_s']:5.1f} tok/s = {m['tok_s'] / plain['tok_s']:.2f}x plain"
          f"{extra}; same tokens as plain: {m['tokens'] == plain['tokens']}")

# %%
alphas = [i / 100 for i in range(0, 100)]
colors = {1: "tab:blue", 3: "tab:orange", 5: "tab:green"}
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
L_line = 26
for k, color in colors.items():
    axes[0].plot(alphas, [expected_tokens(a, k) for a in alphas], "--", color=color,
                 label=f"k={k}: tokens per step (formula)")
    axes[0].plot(alphas, [speedup(a, k, 0.0) for a in alphas], "-", color=color,
                 label=f"k={k}: speed-up, free proposer (model)")
    axes[1].plot(alphas, [speedup(a, k, draft_ms[L_line]) for a in alphas], "-", color=color,
                 label=f"k={k}: speed-up, L={L_line} (model)")
    for L in layer_counts:
        axes[1].plot(alpha_self[L], speedup(alpha_self[L], k, draft_ms[L]), "o", color=color,
                     ms=4)
for L in layer_counts:
    axes[1].annotate(f"L={L}", (alpha_self[L], speedup(alpha_self[L], 1, draft_ms[L])),
                     textcoords="offset points", xytext=(3, 5), fontsize=7)
for name, m in measured.items():
    if m["k"]:
        ax = axes[1] if name.startswith("self") else axes[0]
        ax.plot(m["alpha"], m["tok_s"] / plain["tok_s"], "*", ms=14, color=colors[m["k"]],
                markeredgecolor="black", label=f"{name}: measured in the engine")
for ax in axes:
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("acceptance rate α (per draft)")
    ax.legend(fontsize=6.5, loc="upper left")
axes[0].set_ylabel("tokens per step / speed-up over plain decoding")
axes[0].set_title("n-gram lookup: model from pass costs, and the engine")
axes[1].set_title("self-speculation: early exits of L layers")
fig.tight_layout()
fig.savefig(figure_path("11_speedup.png"), dpi=120)
for k in (1, 3, 5):
    wins = [a for a in alphas if speedup(a, k, 0.0) > 1]
    print(f"model, k={k}: a free proposer "
          + (f"needs α > {wins[0]:.2f}; " if wins else "never wins; ")
          + f"at α = 0.8 it gives {speedup(0.8, k, 0.0):.2f}x; self-speculation "
          + ", ".join(f"L={L}: {speedup(alpha_self[L], k, draft_ms[L]):.2f}x"
                      for L in layer_counts))

# %% [markdown]
# **Figure 11.3.** Left: the expected tokens per step ``(1 − α^(k+1)) / (1 − α)``
# (dashed) and the speed-up it buys with a free proposer (solid), computed from
# the pass costs measured in section 1, for ``k`` of 1, 3 and 5; the stars are
# the engine's measured n-gram runs on the repeat-the-passage request, placed at
# the ``α`` their mean acceptance length implies. Right: the same model with
# SmolLM2's first ``L = 26`` layers as the draft (its measured draft cost), dots
# at the ``α`` that early exits of ``L`` = 8 to 28 layers reach (their greedy
# agreement with the full model, measured above), and the engine's measured
# self-speculation run (star). Look at the left panel: the solid lines sit below
# the dashed ones by the verification pass's extra cost; with the pass costs
# above, a free proposer wins on this CPU once ``α`` exceeds a few percent at
# ``k = 1`` and about 0.25 to 0.35 at ``k = 3`` and 5 (printed above), and a
# larger ``k`` pays only at a higher ``α``; input-grounded text gives n-gram
# lookup such an ``α``. Look at the right panel: SmolLM2 was not
# trained for early exits (LayerSkip trains for them), so its first layers
# seldom agree with the full model, while a
# draft step of ``L`` layers still costs most of a pass (the embedding, the LM
# head and the per-step overhead do not shrink with ``L``): every
# self-speculation point sits below 1, exact but slower. The stars come from
# single runs and move by tens of percent between runs; on the 2-core
# development machine (one thread, load average about 2) n-gram gave 1.64x at
# ``k = 1``, 2.24x at ``k = 3`` and 2.18x at ``k = 5``, and self-speculation
# (``L = 28``, ``k = 3``) 0.55x, a little above its model because the
# back-off pauses drafting while acceptance is low. Every run emitted exactly
# the tokens of plain greedy decoding (printed above).

# %% [markdown]
# What you built
# --------------
#
# Nothing new in code: a measurement of why speculation can pay (a pass over
# ``k + 1`` tokens costs far less than ``k + 1`` passes), an empirical check that the
# rejection sampler keeps the target's distribution whatever the drafts, and the
# speed-up those costs allow against ``α`` and ``k``. The code is in
# ``minivllm/ref/rejection_sampler.py`` (the rule, one request at a time),
# ``minivllm/fast/rejection_sampler.py`` (vectorised, Triton on CUDA),
# ``minivllm/ref/ngram_proposer.py`` and ``minivllm/spec_decode/draft_model.py``
# (the draft-model and self-speculation proposer).

# %% [markdown]
# The test command
# ----------------
#
# The rejection sampler is tested with a chi-square test at every position
# against the target's float64 ``p``, the proposers against oracles and
# transformers (the first ``L`` layers against transformers' model cut after
# layer ``L``):
#
# .. code-block:: bash
#
#    pytest -q tests/test_rejection_sampler.py tests/test_ngram_proposer.py \
#        tests/test_draft_model.py --backend=ref
#    pytest -q tests/test_rejection_sampler.py tests/test_ngram_proposer.py \
#        tests/test_draft_model.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# Task 18 ``rejection_sampler`` (:doc:`/course/18_rejection_sampler`) has you
# write ``verify_greedy`` and ``verify_random`` of
# ``minivllm/ref/rejection_sampler.py`` in your student package: the rule for
# one request, one position at a time.
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task rejection_sampler
