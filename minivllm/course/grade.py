"""Grade a package task by task: ``minivllm course grade --backend PKG``.

One pytest run (a subprocess, so the package under test is imported fresh)
selects the tasks' tests with the plugin's ``--task`` option and writes each
test's outcome with ``--course-report``. A task scores its points when every
one of its tests passes (all or nothing: a stub that happens to pass one
test still scores 0). Hypothesis runs under the ``grade`` profile:
derandomised, so every run grades the same examples, and without shrinking,
so a failure is reported in seconds with the example that failed.

The table ends with ``score: X/Y``; the exit status is 0 only at full marks.
``--json`` and ``--junit`` write the same results for a CI system.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minivllm.course.manifest import TASKS, Task, get_task

#: The repository checkout that holds ``tests/`` (the grader needs the test suite).
REPO_ROOT = Path(__file__).resolve().parents[2]


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
    skipped: int = 0
    seconds: float = 0.0
    failures: list[dict[str, str]] = field(default_factory=list)


def task_test_files(tasks: list[Task]) -> list[str]:
    """The test files the tasks' selectors name, in order, without repeats."""
    files = [pattern.split("::")[0] for task in tasks for pattern in task.tests]
    return list(dict.fromkeys(files))


def run_tests(package: str, tasks: list[Task], *, extra_tests: list[str] = (),
              pythonpath: list[str] = (), repo: Path = REPO_ROOT, stop_early: bool = False,
              timeout: float = 3600) -> tuple[dict, str]:
    """Run the tasks' tests on ``package``; return (the plugin's JSON report, pytest's output)."""
    missing = [f for f in task_test_files(tasks) if not (repo / f).exists()]
    if missing:
        raise ValueError(f"the test files {missing} are not under {repo}; grade from a "
                         f"checkout of the minivllm repository (--repo)")
    with tempfile.TemporaryDirectory(prefix="minivllm-grade-") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--rootdir={repo}", f"--backend={package}",
               f"--course-report={report_path}", "-o", "addopts=", "--tb=no", "-rN"]
        cmd += [f"--task={t.name}" for t in tasks]
        if stop_early:
            cmd.append("-x")
        cmd += task_test_files(tasks) + [str(Path(d).resolve()) for d in extra_tests]
        env = dict(os.environ, HYPOTHESIS_PROFILE="grade", CI="true")
        paths = [str(Path(p).resolve()) for p in pythonpath] + [str(repo)]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)
        output = proc.stdout + proc.stderr
        if not report_path.exists():
            return {"tests": {}, "collect_errors": {"pytest": output[-2000:]}}, output
        return json.loads(report_path.read_text()), output


def score(tasks: list[Task], report: dict) -> list[TaskResult]:
    """Per-task results from the plugin's report."""
    results = []
    for task in tasks:
        r = TaskResult(task.number, task.name, task.points)
        for nodeid, entry in report["tests"].items():
            if task.name not in entry.get("tasks", []):
                continue
            r.tests += 1
            r.seconds += entry["duration"]
            if entry["outcome"] == "failed":
                r.failed += 1
                r.failures.append({"test": nodeid, "message": entry["message"]})
            elif entry["outcome"] == "passed":
                r.passed += 1
            else:
                r.skipped += 1
        for where, message in report.get("collect_errors", {}).items():
            if where == "pytest" or any(p.split("::")[0] == where for p in task.tests):
                r.failures.append({"test": where, "message": f"collection error: {message}"})
        if r.tests == 0 and not r.failures:
            r.failures.append({"test": "-", "message": "no test of this task ran"})
        r.score = task.points if r.passed > 0 and not r.failures else 0
        results.append(r)
    return results


def format_table(results: list[TaskResult], max_failures: int = 2) -> str:
    """The score table, failures underneath, ``score: X/Y`` as the last line."""
    lines = [f"{'#':>2}  {'task':<20} {'tests':>5} {'passed':>7} {'skipped':>7} {'time':>7}  points"]
    for r in results:
        run = r.tests - r.skipped
        lines.append(f"{r.number:>2}  {r.name:<20} {r.tests:>5} {r.passed:>3}/{run:<3} "
                     f"{r.skipped:>7} {r.seconds:>6.1f}s  {r.score:>2}/{r.points}")
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


def write_junit(results: list[TaskResult], report: dict, path: str | Path) -> None:
    """JUnit XML: one test suite per task, one test case per test."""
    root = ET.Element("testsuites", name="minivllm course")
    for r in results:
        suite = ET.SubElement(root, "testsuite", name=f"task_{r.name}", tests=str(r.tests),
                              failures=str(len(r.failures)), time=f"{r.seconds:.3f}")
        messages = {f["test"]: f["message"] for f in r.failures}
        for nodeid, entry in report["tests"].items():
            if r.name not in entry.get("tasks", []):
                continue
            case = ET.SubElement(suite, "testcase", classname=f"task_{r.name}", name=nodeid,
                                 time=f"{entry['duration']:.3f}")
            if entry["outcome"] == "failed":
                ET.SubElement(case, "failure", message=messages.get(nodeid, "")[:1000])
            elif entry["outcome"] == "skipped":
                ET.SubElement(case, "skipped")
        for where, message in messages.items():
            if where not in report["tests"]:
                case = ET.SubElement(suite, "testcase", classname=f"task_{r.name}", name=where)
                ET.SubElement(case, "error", message=message[:1000])
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def grade(package: str, task_names: list[str] | None = None, *, extra_tests: list[str] = (),
          pythonpath: list[str] = (), json_path: str | None = None,
          junit_path: str | None = None, repo: Path = REPO_ROOT) -> tuple[list[TaskResult], str]:
    """Grade ``package`` on the named tasks (all by default); return (results, the table)."""
    tasks = sorted({get_task(n) for n in task_names}, key=lambda t: t.number) if task_names else list(TASKS)
    start = time.perf_counter()
    report, _ = run_tests(package, tasks, extra_tests=extra_tests, pythonpath=pythonpath,
                          repo=repo)
    results = score(tasks, report)
    table = format_table(results)
    if json_path:
        total = sum(r.score for r in results)
        Path(json_path).write_text(json.dumps({
            "backend": package, "score": total, "max_score": sum(r.points for r in results),
            "seconds": time.perf_counter() - start, "tasks": [asdict(r) for r in results],
        }, indent=1))
    if junit_path:
        write_junit(results, report, junit_path)
    return results, table


def submit(package_dir: str | Path, out: str | Path | None = None) -> Path:
    """Zip a student package (its ``.py`` files) for hand-in; return the zip's path."""
    pkg = Path(package_dir).resolve()
    if not (pkg / "__init__.py").exists():
        raise ValueError(f"{pkg} is not a Python package (no __init__.py)")
    out = Path(out) if out else Path(f"{pkg.name}-submission.zip")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(pkg.rglob("*.py")):
            if "__pycache__" not in f.parts:
                z.write(f, Path(pkg.name) / f.relative_to(pkg))
    return out
