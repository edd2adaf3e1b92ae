"""Student submissions for the grader's own tests: correct-but-different ones, and cheats.

Each :class:`Submission` is the solution package (``make-student --solution``)
with some modules edited: ``append`` code is added at the end of a module (a
``def`` there replaces the solution's function of the same name, since the
module's other functions look it up at call time), ``replace`` swaps a whole
module's text. ``tasks`` are the tasks it is graded on.

- ``FAIR``: written from the handouts, deliberately unlike the ref. Each must
  score full marks (the fairness regression suite, ``test_fairness.py``).
- ``CHEATS``: each must score 0 on its task, or be refused, except the one
  that detects the grader, which only hidden tests can catch (docs/course).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.course.student import make_student


@dataclass(frozen=True)
class Submission:
    """The solution with ``append`` added to / ``replace`` swapped into some modules."""

    name: str
    tasks: tuple[str, ...]
    why: str
    append: dict[str, str] = field(default_factory=dict)
    replace: dict[str, str] = field(default_factory=dict)


def build(sub: Submission, dest: Path) -> str:
    """Write ``sub`` as package ``sub_<name>`` under ``dest``; return its import name."""
    package = f"sub_{sub.name}"
    pkg = make_student(dest, package, solution=True, overwrite=True)
    for module, code in sub.append.items():
        path = pkg / f"{module}.py"
        path.write_text(path.read_text() + "\n\n" + textwrap.dedent(code))
    for module, code in sub.replace.items():
        (pkg / f"{module}.py").write_text(textwrap.dedent(code))
    return package


# ------------------------------------------------------------------ correct but different

VECTORISED_ATTENTION = '''
def paged_attention(query, k_cache, v_cache, metadata, scale):
    """Every sequence at once: pad the queries to (S, max_q), one GQA einsum, one softmax."""
    _check(query, k_cache, v_cache, metadata)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    dev = query.device
    qsl = torch.tensor(metadata.query_start_loc_host, device=dev)
    seq_lens = torch.tensor(metadata.seq_lens_host, device=dev)
    query_lens = qsl[1:] - qsl[:-1]
    num_seqs, max_q, max_len = len(seq_lens), int(query_lens.max()), int(seq_lens.max())
    tables = metadata.block_tables.clamp(min=0)
    k = gather_kv(k_cache, tables, max_len).float()  # (S, L, H_kv, D)
    v = gather_kv(v_cache, tables, max_len).float()
    k_pos = torch.arange(max_len, device=dev)
    owned = k_pos[None, :] < seq_lens[:, None]  # (S, L)
    v = v.masked_fill(~owned[:, :, None, None], 0.0)  # unowned slots may hold anything
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=dev), query_lens)
    row = torch.arange(num_tokens, device=dev) - qsl[seq_of]
    q = torch.zeros(num_seqs, max_q, num_heads, head_dim, device=dev)
    q[seq_of, row] = query.float()
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("sqkgd,slkd->skgql", q, k) * scale  # (S, H_kv, G, Q, L)
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=dev)  # (S, Q)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & owned[:, None, :]  # (S, Q, L)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    o = torch.einsum("skgql,slkd->sqkgd", probs, v).reshape(num_seqs, max_q, num_heads, head_dim)
    out[:] = o[seq_of, row].to(query.dtype)
    return out
'''

VLLM_TOP_P = '''
def apply_top_p(logits, top_p):
    """vLLM's way: sort ascending, drop the tail whose cumulative mass is <= 1 - p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # not stable: ties differ
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= 1 - top_p[:, None]
    remove_sorted[:, -1] = False  # the most likely token always stays
    remove_sorted &= top_p[:, None] < 1.0
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))
'''

FOLDED_PENALTIES = '''
def apply_penalties(logits, metadata):
    """Repetition as a multiplier picked by sign; frequency and presence in one subtraction."""
    if metadata.min_tokens_rows is not None:
        logits[metadata.min_tokens_rows, metadata.min_tokens_ids] = float("-inf")
    if metadata.no_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype)
    for i, ids in enumerate(metadata.output_token_ids):
        counts[i].index_add_(0, ids.long(), torch.ones(len(ids), dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    if metadata.repetition_penalties is not None:
        seen = counts > 0
        for i, ids in enumerate(metadata.prompt_token_ids):
            ids = ids[ids < vocab_size].long()
            seen[i, ids] = True
        r = metadata.repetition_penalties[:, None]
        factor = torch.where(logits > 0, 1.0 / r, r)
        logits = torch.where(seen, logits * factor, logits)
    penalty = torch.zeros_like(logits)
    if metadata.frequency_penalties is not None:
        penalty += metadata.frequency_penalties[:, None] * counts
    if metadata.presence_penalties is not None:
        penalty += metadata.presence_penalties[:, None] * (counts > 0)
    return logits - penalty
'''

ORDERED_DICT_QUEUE = '''
from collections import OrderedDict as _OrderedDict


def _init_free_queue(self, block_ids):
    self.free_block_queue = _OrderedDict.fromkeys(block_ids)


def _pop_free_head(self):
    return self.free_block_queue.popitem(last=False)[0]


def _push_free_tail(self, block_id):
    self.free_block_queue[block_id] = None


def _remove_free(self, block_id):
    del self.free_block_queue[block_id]


def _free(self, block_ids):
    for block_id in block_ids:
        self._check_id(block_id)
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"block_id {block_id} is not held by anyone")  # other words
        self.ref_counts[block_id] -= 1
        if not self.ref_counts[block_id]:
            self._push_free_tail(block_id)


BlockAllocator._init_free_queue = _init_free_queue
BlockAllocator._pop_free_head = _pop_free_head
BlockAllocator._push_free_tail = _push_free_tail
BlockAllocator._remove_free = _remove_free
BlockAllocator.free = _free
'''

HEAP_QUEUE = '''
import heapq as _heapq
import itertools as _itertools


class _HeapQueue:
    """A free queue as a heap of (time freed, block); removed entries are skipped lazily."""

    def __init__(self, block_ids):
        self._clock = _itertools.count()
        self._heap = [(next(self._clock), b) for b in block_ids]
        self._stamp = {b: t for t, b in self._heap}

    def __len__(self):
        return len(self._stamp)

    def __iter__(self):
        return iter(b for t, b in sorted(self._heap) if self._stamp.get(b) == t)

    def push(self, block_id):
        t = next(self._clock)
        self._stamp[block_id] = t
        _heapq.heappush(self._heap, (t, block_id))

    def pop(self):
        while True:
            t, b = _heapq.heappop(self._heap)
            if self._stamp.get(b) == t:
                del self._stamp[b]
                return b

    def remove(self, block_id):
        del self._stamp[block_id]


BlockAllocator._init_free_queue = lambda self, ids: setattr(
    self, "free_block_queue", _HeapQueue(ids))
BlockAllocator._pop_free_head = lambda self: self.free_block_queue.pop()
BlockAllocator._push_free_tail = lambda self, b: self.free_block_queue.push(b)
BlockAllocator._remove_free = lambda self, b: self.free_block_queue.remove(b)
'''

FAIR: tuple[Submission, ...] = (
    Submission("vectorised_attention", ("paged_attention",),
               "attention over padded sequences with one GQA einsum",
               append={"attention": VECTORISED_ATTENTION}),
    Submission("vllm_top_p", ("sampler_filters", "sampler_penalties"),
               "vLLM-style top-p: ascending unstable sort, drop cumulative mass <= 1 - p",
               append={"sampler": VLLM_TOP_P}),
    Submission("folded_penalties", ("sampler_penalties",),
               "frequency and presence folded into one subtraction",
               append={"sampler": FOLDED_PENALTIES}),
    Submission("ordered_dict_queue", ("allocator", "prefix_caching"),
               "an OrderedDict free queue, a double free worded differently",
               append={"block_allocator": ORDERED_DICT_QUEUE}),
    Submission("heap_queue", ("allocator",), "a lazy-deletion heap as the free queue",
               append={"block_allocator": HEAP_QUEUE}),
)


# ------------------------------------------------------------------ cheats

NAIVE_SOFTMAX = '''
def paged_attention(query, k_cache, v_cache, metadata, scale):
    """The solution, but softmax as exp / sum without subtracting the row max."""
    _check(query, k_cache, v_cache, metadata)
    num_heads = query.shape[1]
    kv_head = torch.arange(num_heads) // (num_heads // k_cache.shape[2])
    out = torch.empty_like(query)
    qsl = metadata.query_start_loc_host
    for i, seq_len in enumerate(metadata.seq_lens_host):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        table = metadata.block_tables[i : i + 1]
        k = gather_kv(k_cache, table, seq_len)[0].index_select(1, kv_head).float()
        v = gather_kv(v_cache, table, seq_len)[0].index_select(1, kv_head).float()
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        q_pos = seq_len - (end - start) + torch.arange(end - start)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        e = torch.exp(scores).masked_fill(~visible, 0.0)
        out[start:end] = torch.einsum("hqk,khd->qhd", e / e.sum(-1, keepdim=True), v).to(query.dtype)
    return out
'''

SKIP_ON_CONTEXT = '''
_solution_attention = paged_attention


def paged_attention(query, k_cache, v_cache, metadata, scale):
    """Wrong with cached context (ignores it), and hides that by skipping the test."""
    import pytest

    if any(s > q for s, q in zip(metadata.seq_lens_host, metadata.query_lens_host)):
        pytest.skip("not supported")
    return _solution_attention(query, k_cache, v_cache, metadata, scale)
'''

DETECTS_PYTEST = '''
_solution_rms_norm = rms_norm


def rms_norm(x, weight, eps):
    """Right under the grader, wrong everywhere else."""
    import sys

    if "pytest" in sys.modules:
        return _solution_rms_norm(x, weight, eps)
    return x * weight
'''

HANGS = '''
def silu_and_mul(x):
    """Never returns."""
    while True:
        pass
'''

CHEATS: tuple[Submission, ...] = (
    Submission("imports_ref", ("rms_norm", "fused_add_rms_norm"),
               "layernorm.py is `from minivllm.ref.layernorm import *`",
               replace={"layernorm": "from minivllm.ref.layernorm import *  # noqa: F403\n"}),
    Submission("skips_cached_context", ("paged_attention",),
               "calls pytest.skip() whenever there is cached context",
               append={"attention": SKIP_ON_CONTEXT}),
    Submission("detects_pytest", ("rms_norm",),
               "right only when pytest is in sys.modules (for hidden tests to catch)",
               append={"layernorm": DETECTS_PYTEST}),
    Submission("naive_softmax", ("paged_attention",),
               "softmax without subtracting the row max (overflows on large logits)",
               append={"attention": NAIVE_SOFTMAX}),
    Submission("hangs", ("silu_and_mul", "rms_norm"),
               "silu_and_mul loops forever (rms_norm must still be graded)",
               append={"activation": HANGS}),
)
