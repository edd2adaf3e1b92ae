"""Host-side benchmark: ``python -m minivllm.bench host [--out results/bench_host.json]``.

Times the ref and the fast twin of each host-side component on the same
workload, at 64, 256 and 1024 running requests (block_size 16):

- **allocator**: admission/exit churn with prefix caching. ``num_reqs``
  first turns of 8 blocks (the first 4 shared by one of 8 "system prompts")
  then ``num_reqs`` follow-up turns (a finished conversation + 4 blocks) are
  admitted one by one: look up the cache, allocate the rest, cache the full
  blocks; once ``num_reqs / 2`` are live, the oldest leaves (blocks freed
  last-first). The pool has 12 blocks per request, so some cached blocks are
  evicted and follow-ups hit freed blocks in the middle of the free queue.
  The ref's list free queue pays O(pool) per pop and per such hit.
- **block_table**: one step's ``block_table_tensor`` + ``slot_mapping`` for
  all requests (7 in 8 decode 1 token, 1 in 8 runs a 128-token prefill
  chunk); tables hold 10 to 64 blocks of at most 128. The ref builds padded
  Python lists and loops over tokens; the fast twin gathers rows of a
  preallocated tensor and does the slot arithmetic vectorised.
- **scheduler**: one decode step (``schedule()`` + ``update_from_output()``)
  with every request running, each twin using its own allocator and block
  tables (``backend.use_backend("ref" | "fast")`` at construction).

Each number is the median of several timed repeats (``time.perf_counter``);
setup is not timed. Prints a table (ms ref, ms fast, speed-up = ref / fast)
and writes JSON. ``--backend PKG`` adds a column for an import path (a course
student's package: the leaderboard), timed on the same workload, with its
speed-up over the ref.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import torch

from minivllm import backend
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.prefix_hash import hash_request_tokens
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
SIZES = (64, 256, 1024)


def _median_ms(setup: Callable[[], object], run: Callable[[object], None], repeats: int) -> float:
    """Median wall time of ``run(setup())`` over ``repeats`` runs, in ms (setup untimed)."""
    for _ in range(2):  # warm-up: first calls of torch ops and allocators are slower
        run(setup())
    times = []
    for _ in range(repeats):
        state = setup()
        t0 = time.perf_counter()
        run(state)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


# -- allocator ---------------------------------------------------------------------------


def _allocator_workload(num_reqs: int, seed: int = 0) -> list[list[int]]:
    """Block hashes of ``2 * num_reqs`` admissions: first turns, then follow-up turns.

    A first turn is 8 full blocks, the first 4 shared with one of 8 system
    prompts. A follow-up turn resends a finished conversation plus 4 new
    blocks, so it hits that conversation's freed blocks in the free queue.
    """
    rng = random.Random(seed)

    def new_tokens(n_blocks: int) -> list[int]:
        return [rng.randrange(1, 32000) for _ in range(n_blocks * BLOCK_SIZE)]

    prefixes = [new_tokens(4) for _ in range(8)]
    first_turns = [rng.choice(prefixes) + new_tokens(4) for _ in range(num_reqs)]
    follow_ups = [first_turns[i] + new_tokens(4) for i in rng.sample(range(num_reqs), num_reqs)]
    return [hash_request_tokens(BLOCK_SIZE, t) for t in first_turns + follow_ups]


def bench_allocator(impl: str, num_reqs: int, repeats: int) -> float:
    """Median ms of one pass of admission/exit churn through ``impl``'s allocator."""
    module = backend.get("block_allocator", impl)
    workload = _allocator_workload(num_reqs)

    def setup():
        return module.BlockAllocator(12 * num_reqs, BLOCK_SIZE)

    def run(alloc) -> None:
        live: list[list[int]] = []
        for hashes in workload:
            blocks = alloc.get_cached_blocks(hashes[:-1])  # leave one block to compute
            blocks += alloc.allocate(len(hashes) - len(blocks))
            for block_id, block_hash in zip(blocks, hashes):
                alloc.cache_full_block(block_id, block_hash)
            live.append(blocks)
            if len(live) > num_reqs // 2:
                alloc.free(reversed(live.pop(0)))

    return _median_ms(setup, run, repeats)


# -- block tables ------------------------------------------------------------------------


def bench_block_table(impl: str, num_reqs: int, repeats: int) -> float:
    """Median ms of one step's block-table tensor + slot mapping with ``impl``."""
    module = backend.get("block_table", impl)
    rng = random.Random(1)
    max_blocks = 128
    tables = module.BlockTables(num_reqs, max_blocks, BLOCK_SIZE)
    req_ids, starts, counts = [], [], []
    for i in range(num_reqs):
        req_id = f"req{i}"
        num_blocks = rng.randint(10, 64)
        tables.add_request(req_id)
        tables.append_blocks(req_id, rng.sample(range(64 * num_reqs), num_blocks))
        n = 128 if i % 8 == 0 else 1  # a prefill chunk, or a decode
        req_ids.append(req_id)
        starts.append(num_blocks * BLOCK_SIZE - n - rng.randrange(BLOCK_SIZE))
        counts.append(n)

    def run(_) -> None:
        tables.block_table_tensor(req_ids)
        tables.slot_mapping(req_ids, starts, counts)

    return _median_ms(lambda: None, run, repeats)


# -- scheduler ---------------------------------------------------------------------------


def _decoding_scheduler(impl: str, num_reqs: int):
    """A scheduler (of twin ``impl``, with that twin's allocator and tables) where
    ``num_reqs`` requests have finished their prompts and are decoding."""
    with backend.use_backend(impl):
        module = backend.get("scheduler")
        sched = module.Scheduler(
            SchedulerConfig(max_num_seqs=num_reqs, max_num_batched_tokens=16384,
                            max_model_len=2048),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_reqs * 40),
        )
    rng = random.Random(2)
    system_prompt = [rng.randrange(1, 32000) for _ in range(96)]
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    for i in range(num_reqs):
        prompt = system_prompt + [rng.randrange(1, 32000) for _ in range(rng.randint(16, 300))]
        sched.add_request(Request(f"req{i}", prompt, params, eos_token_id=0))
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        _step(sched, rng)
    return sched, rng


def _step(sched, rng: random.Random) -> float:
    """One step with a fake model; returns the seconds spent inside the scheduler."""
    t0 = time.perf_counter()
    out = sched.schedule()
    t1 = time.perf_counter()
    sampled = {
        r.request_id: rng.randrange(1, 32000)
        for r in out.scheduled_requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
    }
    t2 = time.perf_counter()
    sched.update_from_output(out, sampled)
    return (t1 - t0) + (time.perf_counter() - t2)


def bench_scheduler(impl: str, num_reqs: int, repeats: int) -> float:
    """Median ms of one decode step (schedule + update, not the fake model) of ``impl``."""
    sched, rng = _decoding_scheduler(impl, num_reqs)
    for _ in range(2):  # warm-up
        _step(sched, rng)
    return 1e3 * statistics.median(_step(sched, rng) for _ in range(repeats))


# -- driver ------------------------------------------------------------------------------

BENCHMARKS = MappingProxyType({
    "allocator": (bench_allocator, 5),
    "block_table": (bench_block_table, 20),
    "scheduler": (bench_scheduler, 20),
})


def run(sizes: tuple[int, ...] = SIZES, repeat_scale: float = 1.0,
        package: str | None = None) -> list[dict]:
    """Time every benchmark for both twins (and ``package``, if given) at every size."""
    rows = []
    impls = ("ref", "fast") + ((package,) if package else ())
    for name, (fn, repeats) in BENCHMARKS.items():
        for num_reqs in sizes:
            n = max(3, round(repeats * repeat_scale))
            ms = {impl: fn(impl, num_reqs, n) for impl in impls}
            rows.append({
                "component": name,
                "num_reqs": num_reqs,
                "ref_ms": ms["ref"],
                "fast_ms": ms["fast"],
                "speedup": ms["ref"] / ms["fast"],
            })
            if package:  # the leaderboard column: a student's package against both twins
                rows[-1].update(package_ms=ms[package], package_speedup=ms["ref"] / ms[package])
            print_row(rows[-1])
    return rows


def print_header(package: str | None = None) -> None:
    extra = f" {package[:12] + ' ms':>15} {'vs ref':>7}" if package else ""
    print(f"{'component':<12} {'reqs':>6} {'ref ms':>10} {'fast ms':>10} {'speed-up':>9}{extra}")


def print_row(row: dict) -> None:
    extra = (f" {row['package_ms']:>15.3f} {row['package_speedup']:>6.1f}x"
             if "package_ms" in row else "")
    print(f"{row['component']:<12} {row['num_reqs']:>6} {row['ref_ms']:>10.3f} "
          f"{row['fast_ms']:>10.3f} {row['speedup']:>8.1f}x{extra}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m minivllm.bench host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/bench_host.json", help="where to write JSON")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="numbers of running requests")
    p.add_argument("--repeat-scale", type=float, default=1.0,
                   help="multiply every repeat count (min 3)")
    p.add_argument("--backend", default=None, metavar="PKG",
                   help="also time this import path (e.g. a course student package) against "
                        "ref and fast: the leaderboard")
    args = p.parse_args(argv)
    print_header(args.backend)
    rows = run(tuple(args.sizes), args.repeat_scale, args.backend)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__,
            "machine": platform.machine(), "block_size": BLOCK_SIZE}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0
