"""Planted bugs for the state machines (a test helper, not a test module).

Each mutant is a realistic one-line bug in the ref, the kind a student or a
refactor introduces. ``test_mutants.py`` runs the allocator and scheduler
state machines against each mutant with the CI search (derandomised) and
expects a failure: that is the proof that the machines reach shared
blocks, preemption and equal blocks under different parents, instead of
passing by luck. Shrinking is off (:data:`FIND_ONLY`), so each finishes in
seconds.

Mutants are built from the ref through its public methods where possible and
plugged in through the swap layer where it allows; the scheduler mutant edits
one line of the ref's ``schedule`` source, as a
mutation-testing tool would, and says so loudly if that line is gone.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap
import types
from collections.abc import Iterable, Iterator

from hypothesis import HealthCheck, Phase, settings

from minivllm import prefix_hash
from minivllm.ref import block_allocator as ref_block_allocator
from minivllm.ref import scheduler as ref_scheduler

#: The CI search (derandomised, whatever the profile), reporting the first failure unshrunk.
FIND_ONLY = dict(phases=[Phase.explicit, Phase.generate], derandomize=True, database=None,
                 print_blob=False, suppress_health_check=list(HealthCheck))


def find_only(base: settings) -> settings:
    """``base`` (a machine's settings), derandomised and without shrinking."""
    return settings(base, **FIND_ONLY)


class FreeDropsSharedBlocks(ref_block_allocator.BlockAllocator):
    """Bug: ``free`` sets a block's ref count to 0 instead of decrementing it.

    Harmless while every block has one owner; a block shared through the
    prefix cache goes back to the free queue while another request holds it.
    """

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            count = self.ref_count(block_id)
            super().free([block_id] * max(count, 1))  # max: keep the double-free error


#: This module as a student package providing the buggy allocator through the swap
#: layer: ``backend.use_backend({"block_allocator": "mutants"})``.
block_allocator = types.SimpleNamespace(BlockAllocator=FreeDropsSharedBlocks)


def _mutated_method(cls: type, name: str, old: str, new: str):
    """``cls.name`` recompiled from its source with ``old`` replaced by ``new``."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    if old not in source:
        raise AssertionError(
            f"mutant out of date: {cls.__qualname__}.{name} no longer contains {old!r}; "
            "update tests/mutants.py to plant the same bug in the new code"
        )
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(compile(source.replace(old, new), f"<mutant of {cls.__qualname__}.{name}>", "exec"),
         namespace)
    return namespace[name]


class AdmitsWhilePreempting(ref_scheduler.Scheduler):
    """Bug: waiting requests are admitted in the same step that preempted.

    The pool is short in such a step; admitting the request just preempted
    (it is at the front of the queue) or any other one thrashes.
    """

    schedule = _mutated_method(
        ref_scheduler.Scheduler, "schedule",
        "while self.waiting and token_budget > 0 and not preempted_req_ids:",
        "while self.waiting and token_budget > 0:",
    )


@contextlib.contextmanager
def hash_ignores_parent() -> Iterator[None]:
    """Bug, everywhere at once: a block's hash depends on its own tokens only.

    The same tokens after different prefixes then share one cache entry, so a
    request reuses K/V computed for another context. Both the scheduler under
    test and the ref see the bug (they share :mod:`minivllm.prefix_hash`), so
    only the machine's independent KV-content check can catch it.
    """
    original = prefix_hash.hash_block_tokens

    def unchained(parent_block_hash: int | None, token_ids) -> int:
        return original(None, token_ids)

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("minivllm")
               and getattr(m, "hash_block_tokens", None) is original]
    for module in patched:
        module.hash_block_tokens = unchained
    try:
        yield
    finally:
        for module in patched:
            module.hash_block_tokens = original
