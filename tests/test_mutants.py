"""The state machines catch planted bugs, under the CI search, in seconds.

Each test runs an allocator or scheduler state machine against one realistic
bug from ``tests/mutants.py`` and expects it to fail. The search is the CI
profile's (derandomised, the machine's number of runs) without shrinking, so
each test takes well under a few seconds. The control runs, the same
machines on correct code, are ``TestAllocatorMachine`` and
``TestSchedulerMachine`` themselves.

============================  =====================================================
planted bug                   caught by
============================  =====================================================
free() zeroes a shared        allocator machine (ref counts vs. its list of owners);
block's ref count             scheduler machine (pool check, double free)
admits in a preempting step   scheduler machine (ref decisions; its own "a step that
                              preempts admits nobody" check)
block hash ignores parent     scheduler machine, KV-content check only (the ref
                              shares the bug)
============================  =====================================================
"""

from __future__ import annotations

import mutants
import pytest
import test_block_allocator as allocator_tests  # modules, so their tests are not re-collected
import test_scheduler as scheduler_tests
from hypothesis.stateful import run_state_machine_as_test

from minivllm import backend


def _run_scheduler_machine(impl_class=None) -> None:
    """The scheduler machine with ``impl_class`` (None: the swap layer's) under test."""
    machine = type("MutantMachine", (scheduler_tests.SchedulerMachine,),
                   {"impl_class": impl_class})
    run_state_machine_as_test(
        machine, settings=mutants.find_only(scheduler_tests.TestSchedulerMachine.settings)
    )


def test_allocator_machine_catches_free_that_drops_shared_blocks():
    with backend.use_backend({"block_allocator": "mutants"}):
        with pytest.raises((AssertionError, ValueError)):
            run_state_machine_as_test(
                allocator_tests.AllocatorMachine,
                settings=mutants.find_only(allocator_tests.TestAllocatorMachine.settings),
            )


def test_scheduler_machine_catches_free_that_drops_shared_blocks():
    # The scheduler under test, built on the buggy allocator through the swap layer.
    with backend.use_backend({"block_allocator": "mutants"}):
        with pytest.raises((AssertionError, ValueError)):
            _run_scheduler_machine()


def test_scheduler_machine_catches_admission_in_a_preempting_step():
    with pytest.raises(AssertionError):
        _run_scheduler_machine(mutants.AdmitsWhilePreempting)


def test_scheduler_machine_catches_a_block_hash_that_ignores_its_parent():
    # The bug is in both the implementation and the ref: only the KV-content check sees it.
    with mutants.hash_ignores_parent(), pytest.raises(AssertionError, match="another prefix"):
        _run_scheduler_machine()
