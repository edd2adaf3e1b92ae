"""pytest plugin: ``pytest --backend=ref|fast|auto|<import path> [--task NAME]``.

Installed through the ``pytest11`` entry point, so any checkout with minivllm
installed gets the option. Equivalence tests are written once: they ask
``backend.get(component)`` for the implementation under test and compare it
with ``minivllm.ref`` or an independent oracle (plain torch, transformers).

Without CUDA, ``--backend=fast`` (and ``auto`` pointed at fast kernels) runs
the Triton kernels in Triton's interpreter. ``TRITON_INTERPRET=1`` must be set
before Triton is first imported, so it is set here, in ``pytest_configure``,
before any test module is collected.

Course tasks (:mod:`minivllm.course.manifest`): every test a task lists gets
the marker ``task_<name>``, so ``pytest -m task_rms_norm`` selects it, as does
``--task rms_norm`` (repeatable). With an import-path backend the header says
which module serves each component, and a task's tests fail at once, naming
what is missing, if the package does not itself provide what the task grades
(instead of silently testing the ref). ``--course-report PATH`` writes every
test's outcome and tasks as JSON, for ``minivllm course grade``.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from minivllm.backend import BUILTIN


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default="ref",
        help="minivllm backend under test: ref (default), fast, auto, or an import path "
        "to a module providing some components (e.g. mypkg.my_kernels)",
    )
    parser.addoption(
        "--task", action="append", default=[],
        help="run only this course task's tests (repeatable; the names are in "
        "minivllm/course/manifest.py, e.g. rms_norm)",
    )
    parser.addoption(
        "--course-report", default=None, metavar="PATH",
        help="write each test's outcome, duration, first failure line and tasks as JSON",
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    spec = config.getoption("--backend")
    if spec != "ref" and not _has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minivllm import backend
    from minivllm.course.manifest import TASKS
    from minivllm.testing import strategies  # noqa: F401  (registers hypothesis profiles)

    backend.set_backend(spec)
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    for task in TASKS:
        config.addinivalue_line("markers", f"{task.marker}: course task {task.number}, {task.title}")
    config.addinivalue_line("markers", "course_missing(why): the backend lacks what a task grades")
    if config.getoption("--course-report"):
        config.pluginmanager.register(_CourseReport(config.getoption("--course-report")))


def _import_path_spec(config: pytest.Config) -> str | None:
    spec = config.getoption("--backend")
    return None if spec in BUILTIN else spec


def pytest_report_header(config: pytest.Config) -> list[str]:
    interp = " (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    lines = [f"minivllm backend: {config.getoption('--backend')}{interp}"]
    package = _import_path_spec(config)
    if package is not None:
        from minivllm import backend

        try:
            for name, served_by in backend.describe(package).items():
                own = backend.provides(package, name)
                note = "" if own else f"   (not in {package}: the ref twin)"
                lines.append(f"  {name:<16} {served_by}{note}")
        except Exception as e:  # a student's syntax error must not hide every result
            lines.append(f"  importing {package} failed: {type(e).__name__}: {e}")
    return lines


def _select_tasks(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tag every test with its tasks' markers; keep only ``--task`` ones if given."""
    from minivllm.course.manifest import TASKS, get_task, missing_for_task, tasks_for_nodeid

    wanted = [get_task(n).name for n in config.getoption("--task")] if config.getoption(
        "--task") else None
    package = _import_path_spec(config)
    missing: dict[str, str | None] = {}
    selected, deselected = [], []
    for item in items:
        tasks = tasks_for_nodeid(item.nodeid)
        # An instructor's extra test may carry its task marker itself.
        # An instructor's extra test may carry its task marker itself, or live in a
        # file named after the task (test_task_<name>.py).
        stem = item.path.stem
        tasks += [t for t in TASKS if t not in tasks and (
            item.get_closest_marker(t.marker) or stem == f"test_task_{t.name}")]
        for task in tasks:
            item.add_marker(getattr(pytest.mark, task.marker))
            if package is not None:
                if task.name not in missing:
                    missing[task.name] = missing_for_task(package, task)
                if missing[task.name]:
                    item.add_marker(pytest.mark.course_missing(missing[task.name]))
        if wanted is None or any(t.name in wanted for t in tasks):
            selected.append(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `-m task_<name>` needs the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        _select_tasks(config, items)
    except ValueError as e:  # an unknown --task name
        raise pytest.UsageError(str(e)) from None
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("course_missing")
    if mark is not None:
        pytest.fail(mark.args[0], pytrace=False)


class _CourseReport:
    """Collects each test's outcome for the grader and writes it as JSON at the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}
        self.collect_errors: dict[str, str] = {}
        self.start = time.perf_counter()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = _first_failure_line(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0,
                                                      "message": ""})
        entry["duration"] += report.duration
        if report.failed and entry["outcome"] != "failed":
            entry["outcome"] = "failed"
            entry["message"] = _first_failure_line(report)
        elif report.skipped and report.when in ("setup", "call"):
            entry["outcome"] = "skipped"

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.markers = {item.nodeid: sorted(m.name for m in item.iter_markers()
                                            if m.name.startswith("task_"))
                        for item in session.items}

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from minivllm.course.manifest import TASKS

        names = {t.marker: t.name for t in TASKS}
        for nodeid, entry in self.tests.items():
            entry["tasks"] = [names[m] for m in getattr(self, "markers", {}).get(nodeid, [])
                              if m in names]
        with open(self.path, "w") as f:
            json.dump({"exitstatus": int(exitstatus), "tests": self.tests,
                       "collect_errors": self.collect_errors,
                       "seconds": time.perf_counter() - self.start}, f, indent=1)


def _first_failure_line(report: pytest.TestReport) -> str:
    """The failure in a line or two: the exception message, not the traceback."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    text = text.strip()
    return text if len(text) <= 400 else text[:397] + "..."


@pytest.fixture
def backend_spec(request: pytest.FixtureRequest) -> str:
    """The ``--backend`` value under test."""
    return request.config.getoption("--backend")
