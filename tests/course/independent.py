"""A scheduler and a KV cache manager written from the handouts alone (not a test module).

``tests/course/test_contracts.py`` grades them to show that the contract the
handouts state (docs/course/04_kv_cache_manager.md, 05_scheduler.md: what the
engine calls, what each call returns, what it may change) is all the grader
and the engine need, not the ref's internals. Neither subclasses the ref nor
calls it; both are written unlike it on purpose:

- the KV cache manager is a whole module of its own: one ``_Row`` record per
  request in a dict (no ``req_to_blocks`` / ``num_cached_blocks``), hashes
  made only for the blocks a lookup or the cache needs, no sharing (forks are
  Task 20);
- the scheduler is the kit's skeleton (``make-student``: the class with the
  methods the handout does not ask for) with the three methods the student
  writes: a plan dict in place of parallel lists, a loop over a copy of
  ``running``, the budget spent rather than left, new rows from the prefix hits
  plus the new blocks, and ``update_from_output`` reading the output's frozen
  snapshots (``SchedulerOutput.scheduled``).

``older=True`` writes them to the previous rounds' handouts (no
``num_lookahead_tokens``, no ``in_flight``, no ``max_loras`` rule): the engine
must still take them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from minivllm.course.manifest import get_task
from minivllm.course.student import make_student

KV_CACHE_MANAGER = '''
"""A KV cache manager written from docs/course/04_kv_cache_manager.md."""

from dataclasses import dataclass, field

from minivllm.prefix_hash import hash_block_tokens


@dataclass
class _Row:
    blocks: list = field(default_factory=list)
    cached: int = 0  # its leading blocks entered in the prefix cache


class KVCacheManager:
    """One row of block ids per request that holds blocks; no forks."""

    def __init__(self, block_allocator):
        self.pool = block_allocator
        self.size = block_allocator.block_size
        self.rows = {}

    def _hashes(self, request, n):
        """The request's first n chained hashes, made as they are first needed."""
        hashes, tokens = request.block_hashes, request.all_token_ids
        while len(hashes) < n:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.root_block_hash
            hashes.append(hash_block_tokens(parent, tokens[i * self.size:(i + 1) * self.size]))
        return hashes[:n]

    def get_computed_blocks(self, request):
        if not self.pool.enable_prefix_caching:
            return [], 0
        usable = (request.num_tokens - 1) // self.size  # the last token is always computed
        hits = self.pool.lookup_cached_blocks(self._hashes(request, usable))
        return hits, len(hits) * self.size

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=()LOOKAHEAD):
        row = self.rows.get(request.request_id) or _Row(cached=len(new_computed_blocks))
        hits = list(new_computed_blocks)
        end = request.num_computed_tokens + len(hits) * self.size + num_new_tokens
        slots = end + LOOKAHEAD_TOKENS
        need = max(0, -(-slots // self.size) - len(row.blocks) - len(hits))
        revived = sum(self.pool.ref_count(b) == 0 for b in hits)  # cached, but free
        if need + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        fresh = self.pool.allocate(need)
        row.blocks += hits + fresh
        self.rows[request.request_id] = row
        if self.pool.enable_prefix_caching:
            full = min(end, request.num_tokens) // self.size  # final tokens only
            hashes = self._hashes(request, full)
            for i in range(row.cached, full):
                self.pool.cache_full_block(row.blocks[i], hashes[i])
            row.cached = max(row.cached, full)
        return fresh

    def free(self, request):
        row = self.rows.pop(request.request_id, None)
        if row is not None:
            self.pool.free(row.blocks[::-1])

    def get_block_ids(self, request_id):
        row = self.rows.get(request_id)
        return list(row.blocks) if row else []

    def fork(self, parent, child):
        raise NotImplementedError("this manager shares no blocks (Task 20)")

    def take_blocks_to_copy(self):
        return []

    def take_req_ids_to_refresh(self):
        return []
'''

SCHEDULER_METHODS = '''
from minivllm.metadata import SchedulerOutput as _Output
from minivllm.request import RequestStatus as _Status
from minivllm.request import check_stop as _check_stop


def _lookahead(self, upto):
    room = min(self.scheduler_config.num_lookahead_tokens, self.max_model_len - upto)
    return {"num_lookahead_tokens": room} if room > 0 else {}


def _schedule(self, *, in_flight=frozenset()):
    cfg, kv, skip = self.scheduler_config, self.kv_cache_manager, set(in_flight)
    spent, plan, preempted, admitted = 0, {}, [], []
    for request in list(self.running):
        if spent >= cfg.max_num_batched_tokens:
            break
        if request.request_id in skip or request.status != _Status.RUNNING:
            continue  # in flight, or preempted by a request ahead of it
        n = min(request.num_tokens_with_spec - request.num_computed_tokens,
                cfg.max_num_batched_tokens - spent)
        if n == 0:
            continue
        blocks = None
        while blocks is None:
            blocks = kv.allocate_slots(request, n, **_lookahead(self, request.num_computed_tokens + n))
            if blocks is None:
                victim = [r for r in self.running if r.request_id not in skip][-1]
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
        if blocks is None:
            break
        drafts = request.spec_token_ids[:max(0, request.num_computed_tokens + n - request.num_tokens)]
        request.spec_token_ids = []
        plan[request.request_id] = (request, n, blocks, drafts)
        spent += n
    no_slot = []  # LoRA: their adapter would be one too many; they keep their place
    while self.waiting and not preempted and spent < cfg.max_num_batched_tokens:
        if len(self.running) >= cfg.max_num_seqs:
            break
        request = self.waiting[0]
        if LORA_SLOTS and not self._has_lora_slot(request):
            no_slot.append(self.waiting.popleft())
            continue
        hits, cached = kv.get_computed_blocks(request)
        n = request.num_tokens - cached
        if n > cfg.max_num_batched_tokens - spent:
            if not cfg.enable_chunked_prefill:
                break
            n = cfg.max_num_batched_tokens - spent
        blocks = kv.allocate_slots(request, n, hits, **_lookahead(self, cached + n))
        if blocks is None:
            break
        self.running.append(self.waiting.popleft())
        request.status, request.num_computed_tokens = _Status.RUNNING, cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = cached
        plan[request.request_id] = (request, n, [*hits, *blocks], [])
        admitted.append(request)
        spent += n
    for request in reversed(no_slot):
        self.waiting.appendleft(request)
    finished, self.finished_req_ids = self.finished_req_ids, []
    return _Output(
        scheduled_requests=[p[0] for p in plan.values()],
        num_scheduled_tokens={rid: p[1] for rid, p in plan.items()},
        total_num_scheduled_tokens=spent, preempted_req_ids=preempted,
        finished_req_ids=finished, new_req_ids=[r.request_id for r in admitted],
        new_block_ids={rid: p[2] for rid, p in plan.items()},
        scheduled_spec_decode_tokens={rid: p[3] for rid, p in plan.items() if p[3]},
        num_prefix_cache_queries=sum(r.num_tokens for r in admitted),
        num_prefix_cache_hits=sum(r.num_computed_tokens for r in admitted))


def _preempt(self, request):
    self.waiting.appendleft(request)
    request.status, request.num_computed_tokens = _Status.PREEMPTED, 0
    request.spec_token_ids = []
    request.num_preemptions += 1
    self.kv_cache_manager.free(request)


def _update_from_output(self, scheduler_output, sampled_token_ids):
    done = []
    for live, snap in zip(scheduler_output.scheduled_requests, scheduler_output.scheduled):
        if self.requests.get(snap.request_id) is not live:
            continue  # aborted since the step was scheduled
        live.num_computed_tokens += snap.num_scheduled_tokens
        tokens = sampled_token_ids.get(snap.request_id)
        if tokens is None or live.num_computed_tokens < live.num_tokens:
            continue
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        live.num_computed_tokens -= len(snap.spec_token_ids) + 1 - len(tokens)
        for token in tokens:
            live.append_output_token_ids(token)
            if _check_stop(live, self.max_model_len):
                self._free_request(live)
                done.append(live)
                break
    self.running = [r for r in self.running if all(r is not d for d in done)]
    return done


Scheduler.schedule = SCHEDULE
Scheduler._preempt = _preempt
Scheduler.update_from_output = _update_from_output
'''

#: The previous handout's way to return the step: fill in an empty ``SchedulerOutput``
#: (frozen since; the grader names the line instead of failing every test with a traceback).
FILLED_IN_OUTPUT = """

_decide = _schedule


def _schedule(self, *, in_flight=frozenset()):
    decided = _decide(self, in_flight=in_flight)
    output = _Output()
    for request in decided.scheduled_requests:
        output.scheduled_requests.append(request)
        output.num_scheduled_tokens[request.request_id] = \\
            decided.num_scheduled_tokens[request.request_id]
    output.total_num_scheduled_tokens = decided.total_num_scheduled_tokens
    return output
"""


def build(component: str, dest: Path, package: str, older: bool = False,
          filled_in: bool = False) -> str:
    """Write package ``package`` under ``dest`` serving ``component`` ("scheduler" or
    "kv_cache_manager", or "both") from the code above; return its import name.
    ``filled_in``: the scheduler returns its output the previous handout's way."""
    pkg = dest / package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if component in ("kv_cache_manager", "both"):
        lookahead = ("", "0") if older else (", *, num_lookahead_tokens=0", "num_lookahead_tokens")
        code = KV_CACHE_MANAGER.replace("LOOKAHEAD_TOKENS", lookahead[1])
        (pkg / "kv_cache_manager.py").write_text(code.replace("LOOKAHEAD", lookahead[0]))
    if component in ("scheduler", "both"):
        # The kit's skeleton (the stubbed module a student starts from), then the three methods.
        kit = make_student(dest / f"{package}_kit", "kit", tasks=(get_task("scheduler"),))
        skeleton = (kit / "scheduler.py").read_text()
        schedule = "lambda self: _schedule(self)" if older else "_schedule"
        methods = SCHEDULER_METHODS.replace("SCHEDULE", schedule)
        methods = methods.replace("LORA_SLOTS", "False" if older else "True")
        if filled_in:
            methods = methods.replace("\n\nScheduler.schedule", FILLED_IN_OUTPUT + "\n\nScheduler.schedule")
        (pkg / "scheduler.py").write_text(skeleton + "\n\n" + textwrap.dedent(methods))
    return package
