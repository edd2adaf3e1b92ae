"""What quantization costs in quality: perplexity on a fixed text, greedy agreement.

``perplexity`` runs one sequence through a loaded model in a single prefill
(one paged KV cache, blocks in order) and returns ``exp(mean NLL)`` of each
next token, with the logits' argmax at every position; ``greedy_agreement``
is the fraction of positions where two models pick the same next token (on
the same text, so one disagreement does not derail the rest).

``kv_cache_dtype`` (``"auto"``, ``"int8"``, ``"fp8"``) stores that cache
quantized, as the engine would: every token's keys and values are written
quantized and read back dequantized, so each position attends over the
quantized keys and values of all before it (and its own). :data:`LONG_TEXT`
(about 1,100 tokens) measures it at a long context.

Used by ``tutorials/09_bytes_per_weight.py``, ``tests/test_quantization.py``
and ``minivllm bench kvcache``. ``python -m minivllm.bench quality`` (:func:`compare`) measures each
quantization scheme against the float model it was made from, in one run:
perplexity, greedy agreement and the mean KL divergence of the next-token
distributions (a steadier measure than the perplexity of a short text), for
W8A16 / W8A8, W4A16 / W4A8 and the GGUF blocks with float or int8
activations.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm import kv_quant
from minivllm.bench._long_text import LONG_TEXT  # noqa: F401  (re-exported)
from minivllm.config import cdiv
from minivllm.metadata import AttentionMetadata

#: A fixed English text (public-domain style prose) for perplexity.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books far faster than scribes. Within fifty years presses "
    "were working in more than two hundred cities across Europe, and millions of books had "
    "been printed. Cheaper books meant that more people learned to read, and ideas in "
    "science, religion and politics travelled further and faster than before. Historians "
    "still argue about how much the press changed the world, but few doubt that it changed "
    "how knowledge was shared. Today a similar story is told about the internet, which has "
    "made it possible for anyone with a connection to publish to the whole world at almost "
    "no cost."
)


def logits_of(model: Any, token_ids: list[int], block_size: int = 16,
              kv_cache_dtype: str = "auto") -> torch.Tensor:
    """``(T, vocab)`` float32 logits of every position of one sequence, in one prefill
    over a KV cache stored as ``kv_cache_dtype``."""
    attn = model.model.layers[0].self_attn
    param = next(model.parameters())
    num_blocks = cdiv(len(token_ids), block_size)
    dtype = kv_quant.cache_dtype(kv_cache_dtype, param.dtype, param.device)
    kv_caches = [kv_quant.allocate(num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                   dtype, param.device)
                 for _ in model.model.layers]  # fmt: skip
    t = len(token_ids)
    md = AttentionMetadata.build(
        query_lens=[t], seq_lens=[t],
        block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        slot_mapping=torch.arange(t, dtype=torch.int64), device=param.device,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(token_ids, device=param.device),
                       torch.arange(t, device=param.device), kv_caches, md)
        return model.compute_logits(hidden).float().cpu()  # (T, vocab)


def perplexity(model: Any, token_ids: list[int],
               kv_cache_dtype: str = "auto") -> tuple[float, torch.Tensor]:
    """``(perplexity of tokens 1..T-1, argmax next token at positions 0..T-2)``, with the
    KV cache stored as ``kv_cache_dtype``."""
    logits = logits_of(model, token_ids, kv_cache_dtype=kv_cache_dtype)[:-1]  # (T - 1, vocab)
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits, targets)
    return math.exp(nll.item()), logits.argmax(dim=-1)


def greedy_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions where two argmax sequences agree."""
    return (a == b).float().mean().item()


def mean_kl(base_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of ``KL(base || other)`` of the next-token distributions, nats."""
    p = torch.log_softmax(base_logits.double(), dim=-1)
    q = torch.log_softmax(logits.double(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1).mean().item()


#: The schemes :func:`compare` measures by default (see minivllm.model.quantization.SCHEMES).
SCHEMES = ("w8a16", "w8a8", "w4a16", "w4a8", "gguf-a16", "gguf-a8")


def compare(model: str = "smollm2", quantizations=SCHEMES, dtype: torch.dtype = torch.float32,
            backend: Any = None, text: str = TEXT) -> list[dict]:
    """One row per ``quantization=`` value (``None`` first): perplexity of ``text``, its
    change against the float model, greedy agreement with it, and the mean KL divergence."""
    from minivllm import backend as _backend
    from minivllm.model.loader import load_model

    components = _backend.as_components(backend)
    rows: list[dict] = []
    base_logits = base_argmax = None
    ids = None
    for q in (None, *quantizations):
        m, _, tok = load_model(model, dtype=dtype, quantization=q, components=components)
        ids = tok.encode(text) if ids is None else ids
        logits = logits_of(m, ids)[:-1]  # (T - 1, vocab)
        del m
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
        argmax = logits.argmax(dim=-1)
        if base_logits is None:
            base_logits, base_argmax, base_ppl = logits, argmax, math.exp(nll.item())
        ppl = math.exp(nll.item())
        rows.append(dict(quantization=q or "float", perplexity=ppl, vs_float=ppl / base_ppl - 1,
                         greedy_agreement=greedy_agreement(argmax, base_argmax),
                         mean_kl=mean_kl(base_logits, logits), tokens=len(ids)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m minivllm.bench quality [--model M] [--dtype D] [--quantization Q ...]``."""
    import argparse

    from minivllm.bench._harness import describe_machine
    from minivllm.dtype import DTYPES

    p = argparse.ArgumentParser(prog="python -m minivllm.bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--quantization", nargs="+", default=list(SCHEMES))
    p.add_argument("--backend", default=None, help="ref, fast or auto (default: the global)")
    args = p.parse_args(argv)
    rows = compare(args.model, args.quantization, DTYPES[args.dtype], args.backend)
    print(f"{args.model}, {args.dtype}, the fixed text ({rows[0]['tokens']} tokens); "
          f"{describe_machine()}")
    print(f"{'quantization':<14}{'perplexity':>11}{'vs float':>10}{'greedy agr.':>13}"
          f"{'mean KL':>10}")
    for r in rows:
        print(f"{r['quantization']:<14}{r['perplexity']:>11.3f}{r['vs_float']:>+10.2%}"
              f"{r['greedy_agreement']:>13.1%}{r['mean_kl']:>10.4f}")
    return 0
