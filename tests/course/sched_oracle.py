"""Rule checks for a scheduler, written from docs/host_side.md (not a test module).

:func:`run_traffic` drives the scheduler under test with deterministic random
traffic (shared prefixes, repeated prompts, tiny pools, small budgets: lots of
preemption and prefix hits) and checks the scheduling rules after every step
without consulting the ref:

- no request is admitted in a step that preempted one;
- the token budget and ``max_num_seqs`` hold; admission is first come, first served;
- with LoRA adapters (``loras=True``): the running requests hold at most
  ``max_loras`` distinct adapters, and a waiting request is passed over only
  when its adapter would be one too many (vLLM's rule);
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
from minivllm.lora.request import LoRARequest
from minivllm.request import Request

EOS = 0


def make_scheduler(block_size: int, num_blocks: int, max_num_seqs: int, budget: int,
                   max_model_len: int, chunked: bool = True, caching: bool = True,
                   kv_manager_only: bool = False, max_loras: int | None = None):
    """The scheduler under test (``backend.get("scheduler")``); with ``kv_manager_only``,
    the ref scheduler and allocator around the KV cache manager under test."""
    configs = (SchedulerConfig(max_num_seqs, budget, max_model_len, chunked,
                               max_loras=max_loras),
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


def request(req_id: str, prompt: list[int], max_tokens: int, adapter: int = 0) -> Request:
    """A request; ``adapter`` > 0: under the LoRA adapter with that id."""
    lora = None if adapter == 0 else LoRARequest(f"adapter{adapter}", adapter, "/nowhere")
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS,
                   lora_request=lora)


def adapter_of(r: Request) -> int:
    return 0 if r.lora_request is None else r.lora_request.lora_int_id


def check_admission(waiting_before: list[Request], running_before: list[Request],
                    new: list[str], max_loras: int | None, step: int) -> int:
    """The admitted requests are the waiting ones in order, passing over only those whose
    adapter had no slot when their turn came (none without ``max_loras``); returns how
    many were passed over."""
    running = {adapter_of(r) for r in running_before} - {0}
    order = iter(new)
    expected = next(order, None)
    passed_over = 0
    for r in waiting_before:
        if expected is None:
            break
        if r.request_id == expected:
            running.add(adapter_of(r))
            running.discard(0)
            expected = next(order, None)
            continue
        a = adapter_of(r)
        passed_over += 1
        assert max_loras is not None and a != 0 and a not in running \
            and len(running) >= max_loras, (
                f"step {step}: {r.request_id} (adapter {a or 'none'}) was passed over, but "
                f"admission is first come, first served"
                + (f" and the running adapters {sorted(running)} leave it a slot "
                   f"(max_loras={max_loras})" if max_loras is not None else ""))
    assert expected is None, (f"step {step}: admitted {new} out of first-come-first-served "
                              f"order {[r.request_id for r in waiting_before]}")
    return passed_over


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
                kv_manager_only: bool = False, loras: bool = False) -> dict[str, int]:
    """One deterministic random run; returns counts of the rare events it reached.

    ``loras``: requests come under three adapters or none, and ``max_loras`` is 1 or 2.
    """
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4])
    max_model_len = rng.randint(8, 24)
    num_blocks = -(-max_model_len // block_size) + rng.randint(0, 1)
    budget = rng.randint(2, 16)
    max_num_seqs = rng.randint(2, 5)
    max_loras = rng.randint(1, 2) if loras else None
    sched = make_scheduler(block_size, num_blocks, max_num_seqs, budget, max_model_len,
                           caching=caching, kv_manager_only=kv_manager_only,
                           max_loras=max_loras)
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
                adapter = rng.randint(0, 3) if loras else 0
                sched.add_request(request(f"r{next_id}", prompt, rng.randint(1, 6), adapter))
                prompts.append(prompt)
            except ValueError:
                pass
            next_id += 1
        waiting_before = list(sched.waiting)
        running_list = list(sched.running)
        running_before = {r.request_id for r in running_list}
        out = sched.schedule()
        ids = [r.request_id for r in out.scheduled_requests]
        new = [i for i in ids if i not in running_before]
        assert out.total_num_scheduled_tokens <= budget, f"step {step}: over the token budget"
        assert len(sched.running) <= max_num_seqs, f"step {step}: over max_num_seqs"
        seen["lora_skips"] += check_admission(waiting_before, running_list, new, max_loras, step)
        adapters = {adapter_of(r) for r in sched.running} - {0}
        if max_loras is not None:
            assert len(adapters) <= max_loras, (
                f"step {step}: the running requests hold adapters {sorted(adapters)}, "
                f"more than max_loras={max_loras}")

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
