"""Blocks saved by sharing: ``python -m minivllm.bench sharing [options]``.

A component-level simulation of the PagedAttention paper's memory experiment
(section 6.3): no model, the real KV cache manager and block allocator. A
group of sequences grows from one prompt, a token per step each:

- **parallel sampling** (``n`` completions): the prompt is prefilled once and
  ``n - 1`` children fork the parent's blocks; each sequence then generates its
  own number of tokens and is freed when done.
- **beam search** (``width`` beams): every step each beam proposes ``width``
  tokens with random log-probabilities, the ``width`` best candidates by
  cumulative score survive; a beam with ``k`` surviving candidates forks
  ``k - 1`` children, a beam with none is freed at once.

Blocks *with sharing* are what the pool actually holds after each step
(``num_blocks - num_free_blocks``, copies-on-write included). Blocks *without
sharing* are what every sequence would hold with its own copy of its history,
``sum(ceil(num_tokens / block_size))`` over the live sequences: a paged cache
with no fork. The saving is ``1 - shared / unshared``, at the peak and summed
over the steps (the paper reports the latter: 6.1-9.8% for parallel sampling
and 37.6-55.2% for beam search, on Alpaca traces with OPT-13B, block size 16).

:func:`parallel_sampling` and :func:`beam_search` return a :class:`SharingRun`
with the block tables after every step (what ``tutorials/12_sharing_blocks.py``
draws). Prints a table; ``--out`` writes JSON. One group in isolation, with
random lengths and scores: the numbers show how sharing scales with the width,
not the paper's figures, which come from many groups in flight on real traces.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from minivllm import backend
from minivllm.config import cdiv
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class SharingRun:
    """One simulated group: blocks held after each step, with and without sharing.

    ``tables[t]`` maps each live sequence to its block ids after step ``t``;
    ``copies[t]`` lists the copy-on-write ``(src, dst)`` pairs of step ``t``.
    """

    kind: str  # "parallel" or "beam"
    width: int  # n, or the beam width
    block_size: int
    blocks_shared: tuple[int, ...]
    blocks_unshared: tuple[int, ...]
    tables: tuple[dict[str, tuple[int, ...]], ...]
    copies: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_copies(self) -> int:
        return sum(len(c) for c in self.copies)

    @property
    def peak_saving(self) -> float:
        """``1 - peak shared / peak unshared``."""
        return 1 - max(self.blocks_shared) / max(self.blocks_unshared)

    @property
    def saving(self) -> float:
        """``1 - sum shared / sum unshared`` over the steps (the paper's measure)."""
        return 1 - sum(self.blocks_shared) / sum(self.blocks_unshared)


class _Group:
    """Sequences of one group on a KV cache manager, stepped together."""

    def __init__(self, block_size: int, num_blocks: int, components) -> None:
        components = backend.as_components(components)
        alloc = components.block_allocator.BlockAllocator(num_blocks, block_size, False)
        self.alloc, self.bs, self.num_blocks = alloc, block_size, num_blocks
        self.kv = components.kv_cache_manager.KVCacheManager(alloc)
        self.live: dict[str, Request] = {}
        self.next_id = 0
        self.shared: list[int] = []
        self.unshared: list[int] = []
        self.tables: list[dict[str, tuple[int, ...]]] = []
        self.copies: list[tuple[tuple[int, int], ...]] = []

    def new(self, tokens: list[int]) -> Request:
        r = Request(f"s{self.next_id}", tokens, SamplingParams(max_tokens=1))
        self.next_id += 1
        self.live[r.request_id] = r
        return r

    def fork(self, parent: Request) -> Request:
        child = self.new(parent.all_token_ids[: parent.num_computed_tokens])
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        return child

    def free(self, r: Request) -> None:
        self.kv.free(self.live.pop(r.request_id))

    def step(self) -> None:
        """Compute every live sequence's uncomputed tokens; record the pool."""
        for r in self.live.values():
            if self.kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is None:
                raise RuntimeError("the simulated pool is sized to fit every sequence")
            r.num_computed_tokens = r.num_tokens
        self.copies.append(tuple(self.kv.take_blocks_to_copy()))
        self.kv.take_req_ids_to_refresh()  # a worker would rebuild these rows
        self.shared.append(self.num_blocks - self.alloc.num_free_blocks)
        self.unshared.append(sum(cdiv(r.num_tokens, self.bs) for r in self.live.values()))
        self.tables.append({i: tuple(self.kv.get_block_ids(i)) for i in self.live})

    def run(self, kind: str, width: int) -> SharingRun:
        return SharingRun(kind, width, self.bs, tuple(self.shared), tuple(self.unshared),
                          tuple(self.tables), tuple(self.copies))


def parallel_sampling(prompt_len: int, output_lens: list[int], block_size: int = 16,
                      components=None) -> SharingRun:
    """``len(output_lens)`` completions of one prompt; completion ``i`` has ``output_lens[i]``
    tokens. The prompt is prefilled once, then forked."""
    if prompt_len < 1 or not output_lens or min(output_lens) < 1:
        raise ValueError(f"prompt_len and every output length must be >= 1, got {prompt_len} "
                         f"and {output_lens}")
    n = len(output_lens)
    num_blocks = n * cdiv(prompt_len + max(output_lens) + 1, block_size) + n
    group = _Group(block_size, num_blocks, components)
    rng = random.Random(0)
    parent = group.new([rng.randrange(1, 30000) for _ in range(prompt_len)])
    group.step()  # the prefill: its last logits give every completion's first token
    seqs = [parent] + [group.fork(parent) for _ in range(n - 1)]
    remaining = dict(zip((s.request_id for s in seqs), output_lens))
    for s in seqs:
        s.append_output_token_ids(rng.randrange(1, 30000))
    while group.live:
        group.step()
        for s in list(group.live.values()):
            remaining[s.request_id] -= 1
            if remaining[s.request_id] == 0:
                group.free(s)
            else:
                s.append_output_token_ids(rng.randrange(1, 30000))
    return group.run("parallel", n)


def beam_search(prompt_len: int, width: int, output_len: int, block_size: int = 16,
                seed: int = 0, components=None) -> SharingRun:
    """``width`` beams for ``output_len`` steps, scored by random log-probabilities."""
    if prompt_len < 1 or width < 1 or output_len < 1:
        raise ValueError(f"prompt_len, width and output_len must be >= 1, got {prompt_len}, "
                         f"{width}, {output_len}")
    rng = random.Random(seed)
    num_blocks = 2 * width * cdiv(prompt_len + output_len + 1, block_size) + 2 * width
    group = _Group(block_size, num_blocks, components)
    beams = {group.new([rng.randrange(1, 30000) for _ in range(prompt_len)]).request_id: 0.0}
    for _ in range(output_len):
        group.step()
        # Every beam proposes `width` tokens; the best `width` candidates overall survive.
        candidates = []
        for req_id, score in beams.items():
            logits = [rng.gauss(0, 2) for _ in range(width)]
            log_z = math.log(sum(math.exp(x) for x in logits))
            candidates += [(score + x - log_z, req_id, rng.randrange(1, 30000)) for x in logits]
        survivors = sorted(candidates, reverse=True)[:width]
        for req_id in [b for b in beams if all(b != s[1] for s in survivors)]:
            group.free(group.live[req_id])  # a dropped beam frees its blocks at once
        new_beams: dict[str, float] = {}
        tokens = []
        for score, req_id, token in survivors:
            parent = group.live[req_id]
            # The first survivor of a beam continues it; each further one is a fork
            # (before any of them appends its token: they share the computed tokens).
            beam = parent if req_id not in new_beams else group.fork(parent)
            new_beams[beam.request_id] = score
            tokens.append((beam, token))
        for beam, token in tokens:
            beam.append_output_token_ids(token)
        beams = new_beams
    group.step()
    return group.run("beam", width)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.bench sharing",
        description="Parallel sampling and beam search on a real model, shared by fork against "
                    "independent requests (minivllm.bench._sharing_e2e); with --simulate, the "
                    "component-level simulation of the paper's memory experiment (no model).")
    parser.add_argument("--simulate", action="store_true",
                        help="the simulation: blocks only, no model (fast)")
    g = parser.add_argument_group("the engine run (default)")
    g.add_argument("--model", default="smollm2")
    g.add_argument("--backend", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--n", type=int, nargs="+", default=[2, 4, 8], dest="ns")
    g.add_argument("--beam-widths", type=int, nargs="+", default=[2, 4, 8])
    g = parser.add_argument_group("both (engine defaults: 512-token prompt, 64 generated)")
    # Simulation defaults: the means of the paper's Alpaca trace (19.31 prompt, 58.45 output).
    g.add_argument("--prompt-len", type=int, default=None, help="19 simulated, 512 engine")
    g.add_argument("--output-len", type=int, default=None,
                   help="58 simulated, 64 engine; simulated beam search: steps, parallel "
                        "sampling: mean output length (each drawn from 0.5x to 1.5x it)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6], help="simulated")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if not args.simulate:
        from minivllm.bench import _sharing_e2e as sharing_e2e

        rows = sharing_e2e.run(args.model, args.prompt_len or 512, args.output_len or 64,
                               args.ns, args.beam_widths, args.backend, args.dtype,
                               args.block_size, args.seed)
        _write(args, rows)
        return 0
    args.prompt_len = args.prompt_len or 19
    args.output_len = args.output_len or 58
    rng = random.Random(args.seed)
    rows = []
    for width in args.widths:
        lens = [max(1, int(rng.uniform(0.5, 1.5) * args.output_len)) for _ in range(width)]
        runs = (parallel_sampling(args.prompt_len, lens, args.block_size),
                beam_search(args.prompt_len, width, args.output_len, args.block_size, args.seed))
        for run in runs:
            rows.append(dict(kind=run.kind, width=width, peak_blocks_shared=max(run.blocks_shared),
                             peak_blocks_unshared=max(run.blocks_unshared),
                             peak_saving=run.peak_saving, saving=run.saving,
                             copies=run.num_copies))
    print(f"{'kind':<9}{'width':>6}{'peak shared':>13}{'peak unshared':>15}{'peak saving':>13}"
          f"{'saving':>9}{'copies':>8}")
    for r in rows:
        print(f"{r['kind']:<9}{r['width']:>6}{r['peak_blocks_shared']:>13}"
              f"{r['peak_blocks_unshared']:>15}{100 * r['peak_saving']:>12.1f}%"
              f"{100 * r['saving']:>8.1f}%{r['copies']:>8}")
    _write(args, rows)
    return 0


def _write(args, rows: list[dict]) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)},
                                            rows=rows), indent=2))


__all__ = ["SharingRun", "beam_search", "main", "parallel_sampling"]
