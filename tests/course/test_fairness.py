"""The fairness regression suite: correct work written unlike the ref gets full marks.

Each submission in :data:`submissions.FAIR` is the solution with a part rewritten
the way a student who read only the handouts might (vectorised GQA attention over
padded sequences, vLLM's ascending-sort top-p, folded penalties, other free-queue
structures). They are graded on the tasks they touch only, in two pytest runs,
so this stays at about a minute on 2 cores.
"""

from __future__ import annotations

import pytest
from submissions import FAIR, Submission, build

from minivllm.course import grade as grading
from minivllm.course.manifest import get_task


@pytest.fixture
def ref_only(backend_spec):
    if backend_spec != "ref":
        pytest.skip("grades the course kit, not the backend: runs once, under --backend=ref")


def _merge(name: str, subs: list[Submission]) -> Submission:
    append: dict[str, str] = {}
    for sub in subs:
        for module, code in sub.append.items():
            append[module] = append.get(module, "") + "\n\n" + code
    tasks = tuple(dict.fromkeys(t for sub in subs for t in sub.tasks))
    return Submission(name, tasks, "; ".join(s.why for s in subs), append=append)


# Submissions that edit different modules (or different functions of one) share a package.
GROUPS = {
    "fair_a": [s for s in FAIR if s.name != "heap_queue"],
    "fair_b": [s for s in FAIR if s.name == "heap_queue"],
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_correct_but_different_work_gets_full_marks(group, tmp_path, ref_only):
    sub = _merge(group, GROUPS[group])
    package = build(sub, tmp_path)
    tasks = [get_task(t) for t in sub.tasks]
    report, _ = grading.run_tests(package, tasks, pythonpath=[tmp_path])
    for r in grading.score(tasks, report):
        assert r.score == r.points, (
            f"{sub.why}: task {r.name} scored {r.score}/{r.points}; first failure: "
            f"{r.failures[:1]}")
