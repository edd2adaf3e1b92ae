"""What a dtype does to quality: ``python -m minivllm.bench.quality [--dtypes float32 bfloat16]``.

Two measures, each against the first dtype (float32) in one run:

- **perplexity** on a fixed public-domain text (``bench/data/gettysburg.txt``,
  the Gettysburg Address): one prefill of the whole text through minivllm's
  model and kernels, ``exp(mean negative log-likelihood)`` of each next token;
- **greedy agreement**: a few chat prompts generated greedily with
  ``LLM.generate``; the fraction of output tokens equal to the first dtype's
  at the same position, and how many tokens match before the first
  difference (after one, the continuations may differ for good).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

TEXT = Path(__file__).with_name("data") / "gettysburg.txt"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a hash table is in two sentences.", "List three prime numbers."]


def perplexity(model_name: str, dtype: torch.dtype) -> tuple[float, int]:
    """(perplexity of TEXT, tokens scored) with minivllm's model in ``dtype`` on the CPU."""
    from minivllm.metadata import AttentionMetadata
    from minivllm.model.loader import load_model

    model, _, tokenizer = load_model(model_name, dtype=dtype)
    ids = tokenizer.encode(TEXT.read_text())
    n, block = len(ids), 16
    attn = model.model.layers[0].self_attn
    num_blocks = math.ceil(n / block)
    shape = (num_blocks, block, attn.num_kv_heads, attn.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in model.model.layers]  # fmt: skip
    md = AttentionMetadata.build(query_lens=[n], seq_lens=[n],
                                 block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
                                 slot_mapping=torch.arange(n, dtype=torch.int64),
                                 device=torch.device("cpu"))  # fmt: skip
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, md)
        logits = model.compute_logits(hidden)  # (n, vocab) float32
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return math.exp(nll.item()), n - 1


def greedy(model_name: str, dtype: str, max_tokens: int) -> list[list[int]]:
    from minivllm import LLM, SamplingParams

    llm = LLM(model_name, dtype=dtype, device="cpu", max_model_len=512)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                    use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)
    from minivllm.dtype import DTYPES

    base_ppl, base_out = None, None
    print(f"{'dtype':<10}{'perplexity':>12}{'vs first':>10}{'greedy agreement':>18}"
          f"{'tokens before 1st diff':>24}")  # fmt: skip
    for name in args.dtypes:
        ppl, n = perplexity(args.model, DTYPES[name])
        out = greedy(args.model, name, args.max_tokens)
        base_ppl = base_ppl or ppl
        base_out = base_out or out
        same = sum(a == b for x, y in zip(out, base_out) for a, b in zip(x, y))
        total = sum(len(x) for x in base_out)
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                 for x, y in zip(out, base_out)]  # fmt: skip
        print(f"{name:<10}{ppl:>12.3f}{100 * (ppl / base_ppl - 1):>9.2f}%"
              f"{100 * same / total:>17.1f}%{str(first):>24}")  # fmt: skip
    print(f"perplexity over {n} tokens of {TEXT.name}; greedy: {len(PROMPTS)} chat prompts x "
          f"{args.max_tokens} tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
