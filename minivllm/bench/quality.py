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
and ``minivllm bench kvcache``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm import kv_quant
from minivllm.bench.long_text import LONG_TEXT  # noqa: F401  (re-exported)
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
