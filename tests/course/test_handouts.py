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


ROOT_README = DOCS.parents[1] / "README.md"


def test_the_docs_totals_are_the_manifests():
    """Every count the course pages quote (points, tasks, mutants, the score line of an
    empty and of a full package) is the manifest's, so a new task cannot leave them behind."""
    points, tasks, mutants = sum(t.points for t in TASKS), len(TASKS), len(MUTANTS)
    for path in (DOCS / "README.md", ROOT_README):
        page = path.read_text()
        scores = re.findall(r"score: (\d+)/(\d+)", page)
        assert all(int(of) == points for _, of in scores), (
            f"{path.name}: a score line {scores} is not out of the manifest's {points} points")
        assert all(int(got) in (0, points) for got, _ in scores), f"{path.name}: {scores}"
        for n, m in re.findall(r"(\d+) tasks, (\d+) points", page):
            assert (int(n), int(m)) == (tasks, points), (
                f"{path.name} says {n} tasks, {m} points; the manifest has {tasks}, {points}")
        for n in re.findall(r"(\d+) (?:mutants|one-line bugs)", page):
            assert int(n) == mutants, f"{path.name} says {n} mutants; there are {mutants}"
    page = (DOCS / "README.md").read_text()
    assert len(re.findall(r"score: \d+/\d+", page)) >= 2, "the set-up example lost its scores"
    assert re.search(r"\d+ tasks, \d+ points", ROOT_README.read_text())
    for task in TASKS:  # the table's row: | # | [name](page) | component | points ... | mutants |
        row = re.search(rf"^\| {task.number} \| \[{task.name}\]\(.*\|$", page, re.M)
        assert row, f"README.md's table has no row {task.number} for {task.name}"
        cells = [c.strip() for c in row.group(0).strip("|").split("|")]
        assert int(cells[3].split()[0]) == task.points, f"row {task.number}: {cells[3]} points"
        planted = sum(m.task == task.name for m in MUTANTS)
        assert int(cells[5]) == planted, f"row {task.number}: {cells[5]} mutants, not {planted}"
