"""The grader's strictness: each cheat in :data:`submissions.CHEATS` scores nothing.

- importing the ref (``from minivllm.ref.layernorm import *``): refused by the scan;
- ``pytest.skip()`` whenever there is cached context: refused (it imports pytest), and
  without the import, a skip counts as failed (``test_a_skip_counts_as_failed``);
- right only when ``"pytest" in sys.modules``: refused (it names the harness); a
  disguised check is the instructor's to catch with hidden tests (docs/course/README.md);
- softmax without the max: fails the large-logit attention test;
- an infinite loop: its task fails on the timeout and the next task is still graded.
"""

from __future__ import annotations

import textwrap

import pytest
from submissions import CHEATS, build

from minivllm.course import grade as grading
from minivllm.course.manifest import get_task

BY_NAME = {c.name: c for c in CHEATS}


@pytest.fixture
def ref_only(backend_spec):
    if backend_spec != "ref":
        pytest.skip("grades the course kit, not the backend: runs once, under --backend=ref")


def _grade(sub, tmp_path, **kw):
    package = build(sub, tmp_path)
    tasks = [get_task(t) for t in sub.tasks]
    report, _ = grading.run_tests(package, tasks, pythonpath=[tmp_path], **kw)
    return {r.name: r for r in grading.score(tasks, report)}


@pytest.mark.parametrize("name", ["imports_ref", "skips_cached_context", "detects_pytest"])
def test_forbidden_imports_are_refused(name, tmp_path, ref_only):
    results = _grade(BY_NAME[name], tmp_path)
    for r in results.values():
        assert r.score == 0 and r.tests == 0, f"{name}: {r.name} was graded"
        assert "was not graded" in r.failures[0]["message"]
        assert "uses minivllm.ref" in r.failures[0]["message"] or (
            "uses pytest" in r.failures[0]["message"])


def test_a_skip_counts_as_failed(tmp_path, ref_only):
    """The skip cheat with pytest's Skipped exception fetched without naming pytest."""
    sub = BY_NAME["skips_cached_context"]
    hidden = sub.append["attention"].replace("    import pytest\n\n", "").replace(
        'pytest.skip("not supported")', "_skip()")
    hidden += textwrap.dedent('''
        def _skip():
            import sys
            raise sys.modules["_py" + "test.outcomes"].Skipped("not supported")
    ''')
    sub = type(sub)(sub.name + "_hidden", sub.tasks, sub.why, append={"attention": hidden})
    r = _grade(sub, tmp_path, stop_early=True)["paged_attention"]
    assert r.score == 0 and r.failed > 0
    assert "a skipped test counts as failed" in r.failures[0]["message"], r.failures[0]


def test_softmax_without_the_max_fails(tmp_path, ref_only):
    r = _grade(BY_NAME["naive_softmax"], tmp_path)["paged_attention"]
    assert r.score == 0
    assert any("test_large_logits_do_not_overflow" in f["test"] for f in r.failures), r.failures


def test_a_hang_fails_its_task_and_the_grade_goes_on(tmp_path, ref_only):
    results = _grade(BY_NAME["hangs"], tmp_path, test_timeout=20)
    silu, rms = results["silu_and_mul"], results["rms_norm"]
    assert silu.score == 0 and "timed out" in silu.failures[0]["message"], silu.failures
    assert rms.score == rms.points, rms.failures
