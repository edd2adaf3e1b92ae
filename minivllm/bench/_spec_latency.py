"""``minivllm bench latency --speculative-config JSON``: speculative decoding against plain decoding.

Two engines of the same model in one process, one plain and one with the
given ``speculative_config``, run the same batches in turn (plain, speculative,
plain, ...) so that a drifting machine load hits both alike. Two workloads:

- **grounded**: chat prompts that ask the model to repeat a passage (prose
  and code) with one change; the answer copies the prompt, which is where
  n-gram prompt lookup finds its drafts;
- **random**: prompts of random token ids, continued by sampling at
  temperature 1 (seeded per request): the text does not repeat, so n-gram
  drafts are rare and mostly wrong (the back-off case). Greedy would not do:
  SmolLM2's greedy continuation of random tokens falls into a loop, which
  n-gram lookup predicts perfectly.

Each runs at every ``--spec-batch-sizes`` (default 1 and 64), up to
``--output-len`` tokens (EOS ends a request early); grounded is greedy. Reported per row:
decode time per output token after the first step (``ms/tok``, all requests'
tokens together), the speculative engine's speed-up over the plain one
(``plain ms/tok / spec ms/tok``), the draft acceptance rate and the mean
acceptance length (``1 + accepted / drafts``), and whether both engines
emitted identical tokens (greedy: they must).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

PASSAGES = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. "
    "Every night its keeper climbed the narrow stairs, lit the great lamp, and watched "
    "the ships pass safely through the dark water below.",
    "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
    "        total += item.price * item.quantity\n    return total * (1 + tax_rate)\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place mainly in the leaves, inside "
    "small structures called chloroplasts.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
)
CHANGES = (("hundred", "thousand"), ("total", "amount"), ("green", "most"), ("items", "data"))


def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts: repeat passage ``i % 4`` exactly, with one word changed."""
    prompts = []
    for i in range(n):
        passage, (old, new) = PASSAGES[i % len(PASSAGES)], CHANGES[i % len(CHANGES)]
        note = "" if i < len(PASSAGES) else f" (copy {i // len(PASSAGES)})"
        text = (f"Repeat the following text exactly, but replace the word '{old}' with "
                f"'{new}'{note}:\n\n{passage}")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, vocab_size - 1) for _ in range(length)] for _ in range(n)]


def time_run(llm, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> dict:
    """One batch: tokens, decode seconds after the first step, and the spec counters."""
    from minivllm import SamplingParams

    engine = llm.llm_engine
    engine.scheduler.reset_prefix_cache()
    ids = [engine.add_request(None, p, SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=i if temperature else None))
        for i, p in enumerate(prompts)]
    done, lengths, first = {}, {}, None
    counts = dict(drafts=0, draft_tokens=0, accepted=0)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        lengths.update((o.request_id, len(o.outputs[0].token_ids)) for o in outputs)
        if first is None and len(lengths) == len(ids):  # every prompt is prefilled
            first = (time.perf_counter(), sum(lengths.values()))
        counts["drafts"] += stats.num_drafts
        counts["draft_tokens"] += stats.num_draft_tokens
        counts["accepted"] += stats.num_accepted_tokens
        for o in outputs:
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    end = time.perf_counter()
    tokens = [done[i] for i in ids]
    t0, n0 = first if first is not None else (start, 0)
    n_decode = sum(len(t) for t in tokens) - n0
    return dict(tokens=tokens, decode_s=end - t0, n_decode=max(n_decode, 1), **counts)


def measure(plain, spec, prompts, max_tokens: int, iters: int, temperature: float) -> dict:
    """Median ms per decode token of each engine (interleaved runs), and the counters."""
    time_run(plain, [p[:8] for p in prompts[:2]], 4)  # warm up
    time_run(spec, [p[:8] for p in prompts[:2]], 4)
    p_ms, s_ms, last = [], [], {}
    for _ in range(iters):
        a = time_run(plain, prompts, max_tokens, temperature)
        b = time_run(spec, prompts, max_tokens, temperature)
        p_ms.append(1000 * a["decode_s"] / a["n_decode"])
        s_ms.append(1000 * b["decode_s"] / b["n_decode"])
        last = dict(identical=a["tokens"] == b["tokens"], spec=b)
    b = last["spec"]
    p_med, s_med = sorted(p_ms)[len(p_ms) // 2], sorted(s_ms)[len(s_ms) // 2]
    return dict(
        plain_ms_per_token=p_med, spec_ms_per_token=s_med, speedup=p_med / s_med,
        identical=last["identical"] if temperature == 0 else None,  # sampled: may differ
        tokens_per_request=b["n_decode"] / len(prompts),
        acceptance_rate=b["accepted"] / b["draft_tokens"] if b["draft_tokens"] else None,
        mean_acceptance_length=1 + b["accepted"] / b["drafts"] if b["drafts"] else None,
        num_drafts=b["drafts"],
    )


def run(args) -> int:
    """The comparison table for ``args`` (``minivllm bench latency`` arguments)."""
    from minivllm import LLM

    spec_cfg = args.speculative_config
    dtype = args.dtype[0]
    kw = dict(dtype=dtype, backend=args.backend, device=args.device)
    plain = LLM(args.model, **kw)
    spec = LLM(args.model, speculative_config=spec_cfg, **kw)
    tok = plain.get_tokenizer()
    vocab = plain.llm_engine.vocab_size
    rows = []
    for workload in args.spec_workloads:
        for bs in args.spec_batch_sizes:
            prompts = (grounded_prompts(tok, bs) if workload == "grounded"
                       else random_prompts(bs, args.input_len, vocab, args.seed))
            res = measure(plain, spec, prompts, args.output_len, args.num_iters,
                          0.0 if workload == "grounded" else 1.0)
            rows.append(dict(workload=workload, batch_size=bs, **res))
            print(_row(rows[-1]), flush=True)
    plain.shutdown()
    spec.shutdown()
    load = os.getloadavg()
    print(f"speculative_config={json.dumps(spec_cfg)}; {args.model} {dtype}; up to "
          f"{args.output_len} output tokens; median of {args.num_iters}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cpus")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=args.model, speculative_config=spec_cfg,
                                   load_average=load, rows=rows), indent=2))
    print(f"wrote {out}")
    return 0


def _row(r: dict) -> str:
    acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
    return (f"{r['workload']:<9} batch {r['batch_size']:>3}: plain {r['plain_ms_per_token']:7.2f}"
            f" ms/tok, spec {r['spec_ms_per_token']:7.2f} ms/tok, speed-up "
            f"{r['speedup']:.2f}x; acceptance {acc}, mean acceptance length {mal}, "
            f"{r['tokens_per_request']:.0f} tok/request, identical tokens: {r['identical']}")
