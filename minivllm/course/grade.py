"""Grade a package task by task: ``minivllm course grade --backend PKG``.

1. **Scan.** The submission's source is parsed (never imported) and refused,
   with a message saying why, if it imports ``minivllm.ref``,
   ``minivllm.fast``, ``minivllm.testing``, ``minivllm.course`` or pytest
   (:func:`scan_package`): a submission must not hand the grader the
   reference, or reach into the test harness.
2. **Run.** The tasks' tests run in a child pytest process (the package is
   imported there, fresh), each under ``--test-timeout`` (180 s). The child
   streams each outcome, secret-tagged, into a file whose name and secret
   the parent makes up and hands over only after the child has started
   (:class:`minivllm.testing.pytest_plugin._CourseReport`); the parent reads
   it after the child exits and refuses lines with a bad tag. If the child
   hangs past the backstop or dies, the test it was running fails and a fresh
   child runs the rest (``--course-done``). pytest's own exit status and
   output are never trusted for the score.
3. **Score**, in this process. A test passes only if it ran and passed: a
   skipped test counts as failed, except a ``cuda`` test on a machine without
   CUDA (counted apart, as ``cuda``). A task scores its points when all its
   tests pass; a task with :attr:`~minivllm.course.manifest.Task.groups`
   scores each group on its own (partial credit). A collection error in a
   task's file, a test of it that never reported, or a failing hidden test
   zeroes the whole task.

Hypothesis runs under the ``grade`` profile: derandomised, so every run grades
the same examples, and without shrinking, so a failure is reported in seconds.
The table ends with ``score: X/Y``; the exit status is 0 only at full marks.
``--json``, ``--junit`` and ``--gradescope`` write the same results for a CI
system or Gradescope.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from minivllm.course.child import run_child
from minivllm.course.manifest import TASKS, Task, get_task, nodeid_matches
from minivllm.course.reports import (  # noqa: F401  (re-exported)
    TaskResult,
    _belongs,
    format_table,
    gradescope_results,
    write_junit,
)

#: The repository checkout that holds ``tests/`` (the grader needs the test suite).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Seconds one test may run before it fails (``--test-timeout``).
TEST_TIMEOUT = 180.0

#: Imports a submission may not make: the reference and fast implementations, and the
#: test harness (a submission has no business with pytest).
FORBIDDEN_IMPORTS = ("minivllm.ref", "minivllm.fast", "minivllm.testing", "minivllm.course",
                     "pytest", "_pytest")
#: ... except these helpers, which hold no solution (Triton's stand-in where it is missing;
#: the C++ build under minivllm's build lock, which the C++ task's module calls).
ALLOWED_IMPORTS = ("minivllm.fast._no_triton", "minivllm.fast.cpp_build")


def task_test_files(tasks: list[Task]) -> list[str]:
    """The test files the tasks' selectors name, in order, without repeats."""
    files = [pattern.split("::")[0] for task in tasks for pattern in task.tests]
    return list(dict.fromkeys(files))


# ------------------------------------------------------------------ 1. the scan


def _forbidden(module: str) -> bool:
    if any(module == a or module.startswith(a + ".") for a in ALLOWED_IMPORTS):
        return False
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN_IMPORTS)


def find_package(package: str, pythonpath: list[str | Path]) -> Path | None:
    """The directory (or ``.py`` file) of top-level package ``package``, without importing it."""
    top = package.split(".")[0]
    for d in pythonpath:
        for candidate in (Path(d) / top, Path(d) / f"{top}.py"):
            if candidate.exists():
                return candidate
    old = sys.path[:]
    try:
        sys.path[:0] = [str(p) for p in pythonpath]
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = old
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


#: CPython 3.11's parser keeps its recursion-depth check in shared state, so two threads
#: parsing at once (the mutant self-check grades in a thread pool) can fail with
#: "SystemError: AST constructor recursion depth mismatch"; parses take turns.
_AST_LOCK = threading.Lock()


def scan_package(root: Path) -> list[str]:
    """Why the submission at ``root`` is refused: one line per forbidden import (or none).

    Reads every ``.py`` file with :mod:`ast`: ``import X``, ``from X import Y``
    (also ``from minivllm import ref``), and string constants naming a
    forbidden module exactly (``importlib.import_module("minivllm.ref.x")``).
    Code that hides the name (built from pieces at run time) is not caught
    here: that, and detecting the grader, is for the instructor's hidden tests
    and reading the code (docs/course/README.md).
    """
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    problems = []
    for path in files:
        where = path.relative_to(root.parent)
        try:
            with _AST_LOCK:  # see _AST_LOCK
                tree = ast.parse(path.read_text(errors="replace"), filename=str(path))
        except SyntaxError as e:
            problems.append(f"{where}:{e.lineno}: syntax error: {e.msg}")
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.count(" ") == 0 and _forbidden(node.value):
                    names = [node.value]
            bad = next((n for n in names if _forbidden(n)), None)
            if bad:
                problems.append(f"{where}:{node.lineno}: uses {bad}")
    if root.is_dir():
        for hook in ("sitecustomize.py", "usercustomize.py"):
            if (root.parent / hook).exists():
                problems.append(f"{root.parent / hook}: a {hook} beside the package runs before "
                                f"the grader; remove it")
    return problems


# ------------------------------------------------------------------ 2. the run


def _resolve_paths(paths) -> list[str]:
    """Absolute paths, resolved against this process's working directory (the caller's)."""
    return [str(Path(p).resolve()) for p in paths if str(p)]


def _copy_extra_tests(extra_tests: list[str], into: Path) -> list[str]:
    """Copy each instructor's test folder (or file) into its own package ``hidden_<i>``.

    As packages, their modules are imported as ``hidden_<i>.test_task_NAME``, so a
    file named like one of the kit's own (``tests/course/test_task_NAME.py``)
    does not collide with it; each copy is also put on ``PYTHONPATH`` so its
    helper modules import as they did where they came from.
    """
    roots = []
    for i, src in enumerate(extra_tests):
        src = Path(src).resolve()
        if not src.exists():
            raise ValueError(f"--extra-tests {src} does not exist")
        dest = into / f"hidden_{i}_{src.stem}"
        if src.is_dir():
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dest.mkdir()
            shutil.copy(src, dest / src.name)
        (dest / "__init__.py").touch()
        roots.append(dest)
    return [str(r) for r in roots]


def run_tests(package: str, tasks: list[Task], *, extra_tests: list[str] = (),
              pythonpath: list[str] = (), repo: Path = REPO_ROOT, stop_early: bool = False,
              test_timeout: float = TEST_TIMEOUT, timeout: float = 3600,
              max_restarts: int = 4) -> tuple[dict, str]:
    """Run the tasks' tests on ``package``; return (the report, pytest's output).

    The report: ``tests`` (node id -> outcome, duration, message, tasks, cuda),
    ``collect_errors`` (where -> message), ``refused`` (why the submission was
    not run, or None). Relative ``pythonpath`` entries and the caller's
    ``PYTHONPATH`` are resolved against the caller's working directory.
    """
    missing = [f for f in task_test_files(tasks) if not (repo / f).exists()]
    if missing:
        raise ValueError(f"the test files {missing} are not under {repo}; grade from a "
                         f"checkout of the minivllm repository (--repo)")
    paths = _resolve_paths(pythonpath)
    paths += _resolve_paths(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    report: dict = {"tests": {}, "collect_errors": {}, "refused": None}
    root = find_package(package, paths)
    if root is not None:
        problems = scan_package(root)
        if problems:
            report["refused"] = (f"{package} was not graded: a submission must not import the "
                                 f"reference or fast implementations or the test harness; "
                                 + "; ".join(problems[:5]))
            return report, ""
    with tempfile.TemporaryDirectory(prefix="minivllm-grade-") as tmp:
        tmp = Path(tmp)
        hidden = _copy_extra_tests(list(extra_tests), tmp)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--rootdir={repo}", f"--backend={package}",
               "-o", "addopts=", "--tb=no", "-rN", f"--test-timeout={test_timeout}"]
        cmd += [f"--task={t.name}" for t in tasks]
        if stop_early:
            cmd.append("-x")
        cmd += task_test_files(tasks) + hidden
        env = dict(os.environ, HYPOTHESIS_PROFILE="grade", CI="true")
        env["PYTHONPATH"] = os.pathsep.join(paths + hidden + [str(repo)])
        done: set[str] = set()
        outputs = []
        deadline = time.monotonic() + timeout
        for attempt in range(max_restarts + 1):
            run_cmd = list(cmd)
            if done:
                done_file = tmp / f"done-{attempt}.txt"
                done_file.write_text("\n".join(sorted(done)))
                run_cmd.append(f"--course-done={done_file}")
            events, forged, output, killed = run_child(
                run_cmd, env, repo, tmp, max(deadline - time.monotonic(), 1.0))
            outputs.append(output)
            if forged:
                report["refused"] = (f"{forged} result line(s) did not carry this run's secret: "
                                     f"something other than the grader wrote them")
                return report, "".join(outputs)
            finished = _apply_events(report, events)
            done |= finished
            if any(e["ev"] == "done" for e in events) or stop_early and report["tests"] and any(
                    t["outcome"] == "failed" for t in report["tests"].values()):
                break
            # The child died or hung: the test it was running fails; the rest go on.
            running = _running_test(events)
            why = (f"killed after {timeout:g} s" if killed else
                   "the test process died (a crash, os._exit, or a hang in C code past the "
                   f"{test_timeout + 30:g} s backstop)")
            if running is None:
                if not any(e["ev"] == "collected" for e in events):
                    report["collect_errors"].setdefault(
                        "pytest", f"{why} before any test ran: {output.strip()[-1500:]}")
                break
            entry = report["tests"].setdefault(running, {"duration": 0.0, "tasks": [],
                                                         "cuda": False})
            entry.update(outcome="failed", message=why)
            done.add(running)
            if killed or time.monotonic() >= deadline:
                break
        # Tests collected but never reported (a crash with no restart left) fail too;
        # with stop_early they were only cut short by -x, after a failure: dropped.
        for nodeid, entry in list(report["tests"].items()):
            if "outcome" not in entry and stop_early:
                del report["tests"][nodeid]
                continue
            entry.setdefault("outcome", "failed")
            entry.setdefault("message", "did not run: the test process ended first")
    return report, "".join(outputs)


def _apply_events(report: dict, events: list[dict]) -> set[str]:
    """Fold one child's events into ``report``; return the ids it finished."""
    tests, finished = report["tests"], set()
    for e in events:
        if e["ev"] == "collected":
            for nodeid, info in e["items"].items():
                tests.setdefault(nodeid, {"duration": 0.0, **info})
        elif e["ev"] == "collect_error":
            report["collect_errors"][e["where"]] = e["message"]
        elif e["ev"] == "report":
            entry = tests.setdefault(e["id"], {"duration": 0.0, "tasks": [], "cuda": False})
            entry["duration"] += e["duration"]
            if entry.get("outcome") == "failed":
                continue  # the first failure (setup, call or teardown) stands
            if e["outcome"] in ("failed", "cuda_skipped"):
                entry["outcome"], entry["message"] = e["outcome"], e["message"]
            elif e["when"] == "call":
                entry["outcome"], entry["message"] = "passed", ""
        elif e["ev"] == "finish":
            finished.add(e["id"])
    return finished


def _running_test(events: list[dict]) -> str | None:
    """The test that had started and not finished when the child ended."""
    running = None
    for e in events:
        if e["ev"] == "start":
            running = e["id"]
        elif e["ev"] == "finish" and e["id"] == running:
            running = None
    return running


# ------------------------------------------------------------------ 3. the score


def _collect_error_hits(task: Task, where: str) -> bool:
    """Whether a collection error at ``where`` (a file's node id) costs ``task`` its points:
    its own files, a hidden ``test_task_<name>.py`` of it, and anything else that is
    not a file of another task (the session, a hidden file of no task)."""
    file = where.split("::")[0]
    if any(p.split("::")[0] == file for p in task.tests):
        return True
    owners = [t for t in TASKS if any(p.split("::")[0] == file for p in t.tests)
              or Path(file).stem == f"test_task_{t.name}"]
    return not owners or task in owners


def score(tasks: list[Task], report: dict) -> list[TaskResult]:
    """Per-task results from the report (see the module docstring for the rules)."""
    results = []
    for task in tasks:
        r = TaskResult(task.number, task.name, task.points)
        if report.get("refused"):
            r.failures.append({"test": "-", "message": report["refused"]})
            results.append(r)
            continue
        groups = task.groups or ((task.title, task.tests, task.points),)
        tally = [{"group": label, "points": pts, "score": 0, "passed": 0, "failed": 0}
                 for label, _, pts in groups]
        task_wide_failure = False
        for nodeid, entry in report["tests"].items():
            if not _belongs(task, nodeid, entry):
                continue
            r.tests += 1
            r.seconds += entry["duration"]
            g = next((i for i, (_, sel, _) in enumerate(groups)
                      if any(nodeid_matches(nodeid, p) for p in sel)), None)
            outcome = entry.get("outcome", "failed")
            if outcome == "cuda_skipped":
                r.cuda_skipped += 1
            elif outcome == "passed":
                r.passed += 1
                if g is not None:
                    tally[g]["passed"] += 1
            else:
                r.failed += 1
                r.failures.append({"test": nodeid, "message": entry.get("message", "")})
                if g is None:
                    task_wide_failure = True  # a hidden test, or one no group names
                else:
                    tally[g]["failed"] += 1
        for where, message in report.get("collect_errors", {}).items():
            if _collect_error_hits(task, where):
                r.failures.append({"test": where, "message": f"collection error: {message}"})
                task_wide_failure = True
        if r.tests - r.cuda_skipped == 0 and not r.failures:
            r.failures.append({"test": "-", "message": "no test of this task ran"})
            task_wide_failure = True
        for t in tally:
            t["score"] = t["points"] if t["passed"] > 0 and not t["failed"] else 0
        r.groups = tally
        r.score = 0 if task_wide_failure else sum(t["score"] for t in tally)
        results.append(r)
    return results


def grade(package: str, task_names: list[str] | None = None, *, extra_tests: list[str] = (),
          pythonpath: list[str] = (), json_path: str | None = None,
          junit_path: str | None = None, gradescope_path: str | None = None,
          repo: Path = REPO_ROOT, test_timeout: float = TEST_TIMEOUT,
          ) -> tuple[list[TaskResult], str]:
    """Grade ``package`` on the named tasks (all by default); return (results, the table).

    Relative paths (``pythonpath``, ``extra_tests``, the output files) are the
    caller's: resolved against this process's working directory.
    """
    tasks = sorted({get_task(n) for n in task_names}, key=lambda t: t.number) if task_names else list(TASKS)
    start = time.perf_counter()
    report, _ = run_tests(package, tasks, extra_tests=extra_tests, pythonpath=pythonpath,
                          repo=repo, test_timeout=test_timeout)
    results = score(tasks, report)
    table = format_table(results)
    seconds = time.perf_counter() - start
    if json_path:
        total = sum(r.score for r in results)
        Path(json_path).write_text(json.dumps({
            "backend": package, "score": total, "max_score": sum(r.points for r in results),
            "seconds": seconds, "refused": report.get("refused"),
            "tasks": [asdict(r) for r in results],
        }, indent=1))
    if junit_path:
        write_junit(results, report, junit_path)
    if gradescope_path:
        Path(gradescope_path).write_text(json.dumps(gradescope_results(results, seconds),
                                                    indent=1))
    return results, table


#: What ``submit`` packs: the Python modules and the C++ sources of the kernel tasks.
