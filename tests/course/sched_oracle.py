"""Rule checks for a scheduler, written from docs/host_side.md (not a test module).

:func:`run_traffic` drives the scheduler under test with deterministic random
traffic (shared prefixes, repeated prompts, tiny pools, small budgets: lots of
preemption and prefix hits) and checks the scheduling rules after every step
without consulting the ref:

- no request is admitted in a step that preempted one;
- the token budget and ``max_num_seqs`` hold; admission is first come, first served;
- a prefix-cache hit only ever reuses K/V computed for exactly the same tokens
  at the same positions (every cache slot remembers the token prefix it was
  computed under);
- ref counts equal the number of running requests holding a block; no leaks;
- every request finishes; the pool is whole again at the end.
"""

from __future__ import annotations

import random
from collections import Counter

from minivllm import SamplingParams, backend
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.request import Request

EOS = 0


def make_scheduler(block_size: int, num_blocks: int, max_num_seqs: int, budget: int,
                   max_model_len: int, chunked: bool = True, caching: bool = True,
                   kv_manager_only: bool = False):
    """The scheduler under test (``backend.get("scheduler")``); with ``kv_manager_only``,
    the ref scheduler and allocator around the KV cache manager under test."""
    configs = (SchedulerConfig(max_num_seqs, budget, max_model_len, chunked),
               CacheConfig(block_size, num_blocks, caching))
    if kv_manager_only:
        return ref_scheduler_with_kv_manager(*configs)
    return backend.get("scheduler").Scheduler(*configs)


def ref_scheduler_with_kv_manager(scheduler_config: SchedulerConfig, cache_config: CacheConfig):
    """The ref scheduler and block allocator, with the KV cache manager under test: how the
    KV manager task is graded without depending on the scheduler and allocator tasks."""
    from minivllm.ref import scheduler as ref_scheduler

    kv_cls = backend.get("kv_cache_manager").KVCacheManager
    with backend.use_backend("ref"):
        return ref_scheduler.Scheduler(scheduler_config, cache_config, kv_cache_manager_cls=kv_cls)


def request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS)


class SlotContents:
    """What each cache slot holds: the token prefix its K/V was computed under."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, sched, req: Request, start: int, n: int) -> None:
        blocks, bs = sched.get_block_ids(req.request_id), sched.block_size
        for pos in range(start, start + n):
            self.slots[(blocks[pos // bs], pos % bs)] = tuple(req.all_token_ids[: pos + 1])

    def check_hit(self, sched, req: Request, num_cached: int, step: int) -> None:
        blocks, bs = sched.get_block_ids(req.request_id), sched.block_size
        for pos in range(num_cached):
            held = self.slots.get((blocks[pos // bs], pos % bs))
            assert held == tuple(req.all_token_ids[: pos + 1]), (
                f"step {step}: {req.request_id} reuses block {blocks[pos // bs]} for position "
                f"{pos}, but that slot was computed for other tokens (a prefix-cache hit on a "
                f"block whose earlier blocks differ)")


def check_pool(sched, num_blocks: int, step: int) -> None:
    owners = Counter(b for r in sched.running for b in sched.get_block_ids(r.request_id))
    alloc = sched.block_allocator
    free = alloc.get_free_block_ids()
    for b in range(num_blocks):
        assert alloc.ref_count(b) == owners[b], (
            f"step {step}: block {b} has ref count {alloc.ref_count(b)} but {owners[b]} running "
            f"requests hold it")
        assert not (owners[b] and b in free), f"step {step}: block {b} is held and also free"
    assert len(free) + len(owners) == num_blocks, f"step {step}: a block leaked"


def run_traffic(seed: int, caching: bool = True, steps: int = 80,
                kv_manager_only: bool = False) -> dict[str, int]:
    """One deterministic random run; returns counts of the rare events it reached."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4])
    max_model_len = rng.randint(8, 24)
    num_blocks = -(-max_model_len // block_size) + rng.randint(0, 1)
    budget = rng.randint(2, 16)
    max_num_seqs = rng.randint(2, 5)
    sched = make_scheduler(block_size, num_blocks, max_num_seqs, budget, max_model_len,
                           caching=caching, kv_manager_only=kv_manager_only)
    contents = SlotContents()
    prefixes = [[rng.randint(1, 9) for _ in range(8)] for _ in range(2)]
    prompts: list[list[int]] = []
    seen = Counter()
    next_id = 0
    step, limit = 0, steps + 1
    while step < limit:
        if step == steps:  # arrivals are over: every request must finish within a bound
            limit = step + 10 + sched.get_num_unfinished_requests() * (max_model_len + 1)
        if step < steps and rng.random() < 0.6:
            if prompts and rng.random() < 0.3:
                prompt = list(rng.choice(prompts))  # the same prompt again: a full hit
            else:
                # A shared prefix, or one of its blocks moved to the front (same tokens,
                # other parent), then a random tail.
                p = rng.choice(prefixes)
                cut = rng.randint(0, len(p))
                prompt = (p[cut:] if rng.random() < 0.3 else p[:cut]) + [
                    rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
            prompt = prompt[: max_model_len - 1]
            try:
                sched.add_request(request(f"r{next_id}", prompt, rng.randint(1, 6)))
                prompts.append(prompt)
            except ValueError:
                pass
            next_id += 1
        waiting_before = [r.request_id for r in sched.waiting]
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        ids = [r.request_id for r in out.scheduled_requests]
        new = [i for i in ids if i not in running_before]
        assert out.total_num_scheduled_tokens <= budget, f"step {step}: over the token budget"
        assert len(sched.running) <= max_num_seqs, f"step {step}: over max_num_seqs"
        assert new == waiting_before[: len(new)], (
            f"step {step}: admitted {new} out of first-come-first-served order {waiting_before}")
        if out.preempted_req_ids:
            seen["preemptions"] += 1
            assert not new, (f"step {step}: admitted {new} in a step that preempted "
                             f"{list(out.preempted_req_ids)}")
            assert not set(ids) & set(out.preempted_req_ids), (
                f"step {step}: {sorted(set(ids) & set(out.preempted_req_ids))} both preempted "
                f"and scheduled")
        for r in out.scheduled_requests:
            if r.request_id in new and r.num_computed_tokens > 0:
                seen["prefix_hits"] += 1
                contents.check_hit(sched, r, r.num_computed_tokens, step)
            contents.write(sched, r, r.num_computed_tokens, out.num_scheduled_tokens[r.request_id])
        sampled = {r.request_id: rng.choice([EOS, rng.randint(1, 9)])
                   for r in out.scheduled_requests
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
        sched.update_from_output(out, sampled)
        check_pool(sched, num_blocks, step)
        if step >= steps and not sched.has_unfinished_requests():
            break
        step += 1
    assert not sched.has_unfinished_requests(), f"requests left after {step} steps: no progress"
    assert sched.num_free_blocks == num_blocks, "blocks still held at the end"
    return dict(seen)
