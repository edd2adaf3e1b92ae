"""The handouts in docs/course/ stay in sync with the task manifest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minivllm.course.manifest import TASKS
from minivllm.course.mutants import MUTANTS
from minivllm.course.student import handout_name

DOCS = Path(__file__).resolve().parents[2] / "docs" / "course"


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_each_task_has_a_page_that_matches_the_manifest(task):
    path = DOCS / handout_name(task)
    assert path.exists(), f"no handout {path.name} for task {task.name}"
    page = path.read_text()
    needed = [f"# Task {task.number}: {task.title}", f"**Points:** {task.points}",
              f"`{task.module}.py`", f"--task {task.name}", f"task_{task.name}"]
    needed += [f"`{f}`" for f in task.functions] + [f"`{p}`" for p in task.tests]
    needed += list(task.reading) + [f"`{m.name}`" for m in MUTANTS if m.task == task.name]
    missing = [n for n in needed if n not in page]
    assert not missing, f"{path.name} is out of date with the manifest: missing {missing}"


def test_no_page_for_a_task_that_does_not_exist():
    pages = {p.name for p in DOCS.glob("[0-9][0-9]_*.md")}
    assert pages == {handout_name(t) for t in TASKS}


def test_the_instructors_page_lists_every_task_and_command():
    page = (DOCS / "README.md").read_text()
    for task in TASKS:
        assert f"[{task.name}]({handout_name(task)})" in page, f"README.md lacks {task.name}"
    for command in ("make-student", "course grade", "--extra-tests", "selfcheck", "submit"):
        assert command in page
    total = re.search(r"\*\*Total: (\d+) points\*\*", page)
    assert total and int(total.group(1)) == sum(t.points for t in TASKS)
