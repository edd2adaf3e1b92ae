"""How a grade is reported (a table, JUnit XML, Gradescope's JSON), and a hand-in zip.

:func:`minivllm.course.grade.grade` scores each task into a :class:`TaskResult`;
these functions write the results the ways a course's tools read them.
:func:`submit` packs a student's package for hand-in.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.course.manifest import Task, get_task, tasks_for_nodeid


@dataclass
class TaskResult:
    """How one task went."""

    number: int
    name: str
    points: int
    score: int = 0
    tests: int = 0
    passed: int = 0
    failed: int = 0
    cuda_skipped: int = 0
    seconds: float = 0.0
    failures: list[dict[str, str]] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)


def format_table(results: list[TaskResult], max_failures: int = 2) -> str:
    """The score table, failures underneath, ``score: X/Y`` as the last line."""
    lines = [f"{'#':>2}  {'task':<20} {'tests':>5} {'passed':>7} {'cuda':>5} {'time':>7}  points"]
    for r in results:
        run = r.tests - r.cuda_skipped
        partial = "" if len(r.groups) < 2 else "  (" + ", ".join(
            f"{g['group']} {g['score']}/{g['points']}" for g in r.groups) + ")"
        lines.append(f"{r.number:>2}  {r.name:<20} {r.tests:>5} {r.passed:>3}/{run:<3} "
                     f"{r.cuda_skipped:>5} {r.seconds:>6.1f}s  {r.score:>2}/{r.points}{partial}")
    if any(r.cuda_skipped for r in results):
        lines.append("(cuda: tests that need a CUDA device, not run on this machine; they "
                     "count neither way)")
    failing = [r for r in results if r.failures]
    if failing:
        lines.append("")
        lines.append("failures (first of each task):")
        for r in failing:
            for f in r.failures[:max_failures]:
                message = " ".join(f["message"].split())[:300]
                lines.append(f"  {r.name}: {f['test']}\n      {message}")
            if len(r.failures) > max_failures:
                lines.append(f"  {r.name}: ... {len(r.failures) - max_failures} more")
    total, best = sum(r.score for r in results), sum(r.points for r in results)
    lines.append("")
    lines.append(f"score: {total}/{best}")
    return "\n".join(lines)


def _belongs(task: Task, nodeid: str, entry: dict) -> bool:
    return task.name in entry.get("tasks", []) or task in tasks_for_nodeid(nodeid)


def _task_tests(r: TaskResult, report: dict) -> list[tuple[str, dict]]:
    task = get_task(r.name)
    return [(n, e) for n, e in report["tests"].items() if _belongs(task, n, e)]


def write_junit(results: list[TaskResult], report: dict, path: str | Path) -> None:
    """JUnit XML: one test suite per task, one test case per test."""
    root = ET.Element("testsuites", name="minivllm course")
    for r in results:
        suite = ET.SubElement(root, "testsuite", name=f"task_{r.name}", tests=str(r.tests),
                              failures=str(len(r.failures)), time=f"{r.seconds:.3f}")
        messages = {f["test"]: f["message"] for f in r.failures}
        for nodeid, entry in _task_tests(r, report):
            case = ET.SubElement(suite, "testcase", classname=f"task_{r.name}", name=nodeid,
                                 time=f"{entry['duration']:.3f}")
            if entry.get("outcome") == "failed":
                ET.SubElement(case, "failure", message=messages.get(nodeid, "")[:1000])
            elif entry.get("outcome") == "cuda_skipped":
                ET.SubElement(case, "skipped", message="needs a CUDA device")
        for where, message in messages.items():
            if where not in report["tests"]:
                case = ET.SubElement(suite, "testcase", classname=f"task_{r.name}", name=where)
                ET.SubElement(case, "error", message=message[:1000])
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def gradescope_results(results: list[TaskResult], seconds: float) -> dict:
    """Gradescope's autograder ``results.json``: one entry per task (per group with partial
    credit), each with name, score, max_score, output and visibility; the total on top."""
    tests = []
    for r in results:
        groups = r.groups if len(r.groups) > 1 else [
            {"group": "", "points": r.points, "score": r.score}]
        lines = [f"{r.passed}/{r.tests - r.cuda_skipped} tests passed"
                 + (f" ({r.cuda_skipped} need CUDA, not run)" if r.cuda_skipped else "")]
        lines += [f"{f['test']}: {' '.join(f['message'].split())[:500]}" for f in r.failures[:5]]
        if len(r.failures) > 5:
            lines.append(f"... {len(r.failures) - 5} more failures")
        for g in groups:
            name = f"Task {r.number} ({r.name})" + (f": {g['group']}" if g["group"] else "")
            score_ = g["score"] if r.score else 0  # a task-wide failure zeroes every group
            tests.append({"name": name, "number": str(r.number), "score": score_,
                          "max_score": g["points"], "output": "\n".join(lines),
                          "visibility": "visible"})
    return {"score": sum(t["score"] for t in tests), "execution_time": round(seconds, 1),
            "output": f"minivllm course: {len(results)} tasks", "visibility": "visible",
            "stdout_visibility": "hidden", "tests": tests}


#: The files of a package that a hand-in carries.
SUBMITTED = ("*.py", "*.cpp", "*.h")


def submit(package_dir: str | Path, out: str | Path | None = None) -> Path:
    """Zip a student package (its ``.py``, ``.cpp`` and ``.h`` files) for hand-in."""
    pkg = Path(package_dir).resolve()
    if not (pkg / "__init__.py").exists():
        raise ValueError(f"{pkg} is not a Python package (no __init__.py)")
    out = Path(out) if out else Path(f"{pkg.name}-submission.zip")
    files = sorted({f for pattern in SUBMITTED for f in pkg.rglob(pattern)})
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            if "__pycache__" not in f.parts:
                z.write(f, Path(pkg.name) / f.relative_to(pkg))
    return out
