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
(instead of silently testing the ref). ``--task`` run from a folder without
the tests says where they are.

For ``minivllm course grade``: ``--course-channel FD`` streams every test's
outcome, secret-tagged, to a file the grader names only after this process
has started (:class:`_CourseReport`); ``--course-done FILE`` skips tests a
crashed run already finished; ``--test-timeout SECONDS`` fails a test that runs
too long (SIGALRM, with a faulthandler backstop for hangs inside C code).
"""

from __future__ import annotations

import faulthandler
import hashlib
import hmac
import json
import os
import signal
from pathlib import Path

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
        "--course-channel", default=None, type=int, metavar="FD",
        help="(for minivllm course grade) read the report's secret and path from pipe FD",
    )
    parser.addoption(
        "--course-done", default=None, metavar="FILE",
        help="(for minivllm course grade) deselect the test ids listed in FILE, one a line",
    )
    parser.addoption(
        "--test-timeout", default=0.0, type=float, metavar="SECONDS",
        help="fail a test that runs longer than this (0: no limit; the grader uses 180)",
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    # First, before anything imports the package under test: the grader's secret.
    if config.getoption("--course-channel") is not None:
        secret, path = _read_channel(config.getoption("--course-channel"))
        config.pluginmanager.register(_CourseReport(path, secret), "minivllm-course-report")
    _TIMEOUT[0] = config.getoption("--test-timeout")
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
    done_file = config.getoption("--course-done")
    done = set(Path(done_file).read_text().splitlines()) if done_file else set()
    missing: dict[str, str | None] = {}
    selected, deselected = [], []
    for item in items:
        if item.nodeid in done:  # the grader's rerun after a crash: finished already
            deselected.append(item)
            continue
        tasks = tasks_for_nodeid(item.nodeid)
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
    if wanted is not None and not selected and not done:
        config.stash[_NO_TASK_TESTS] = wanted
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


_NO_TASK_TESTS = pytest.StashKey[list]()
#: The checkout whose tests/ the course tasks name.
REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    wanted = config.stash.get(_NO_TASK_TESTS, None)
    if wanted:
        tests = REPO_ROOT / "tests"
        terminalreporter.write_line(
            f"minivllm: no test of task(s) {', '.join(wanted)} was collected from "
            f"{config.invocation_params.dir}. The course tests live in {tests}: run "
            f"`cd {REPO_ROOT} && pytest --backend=... --task {wanted[0]}` "
            f"(or `minivllm course grade`, which works from any folder).", yellow=True)


@pytest.hookimpl(tryfirst=True)  # before skipif: a package lacking the component fails
def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("course_missing")
    if mark is not None:
        pytest.fail(mark.args[0], pytrace=False)


class _CourseReport:
    """Streams each test's outcome to the grader, one secret-tagged JSON line per event.

    The grader (:func:`minivllm.course.grade.run_tests`) passes a pipe as
    ``--course-channel FD`` and, only after this process has started, writes a
    per-run secret and the path of a fresh result file into it. They are read
    here, in ``pytest_configure``, before the package under test is imported,
    and every line written carries ``HMAC(secret, line)``: a file prepared
    beforehand, or lines written by anything that does not know the secret,
    are refused by the grader. Lines are flushed as they happen, so when this
    process hangs or dies the grader knows what had finished and what was
    running. (Code running inside this process could read the secret out of
    memory: see docs/course/README.md for how far the guarantee goes.)

    Outcomes: ``passed``, ``failed``, and ``cuda_skipped`` for a test marked
    ``cuda`` on a machine without CUDA. Any other skip is reported as
    ``failed``: a test a submission skipped has not been passed.
    """

    def __init__(self, path: str, secret: bytes) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115  (open for the session)
        self._secret = secret
        self._cuda = _has_cuda()
        self._cuda_items: set[str] = set()

    def emit(self, **event) -> None:
        line = json.dumps(event, sort_keys=True)
        tag = hmac.new(self._secret, line.encode(), hashlib.sha256).hexdigest()
        self._file.write(f"{tag} {line}\n")
        self._file.flush()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.emit(ev="collect_error", where=report.nodeid or "<session>",
                      path=str(getattr(report, "fspath", "") or ""),
                      message=_first_failure_line(report))

    @pytest.hookimpl(trylast=True)  # after -m / --task / --course-done deselection
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        from minivllm.course.manifest import TASKS

        names = {t.marker: t.name for t in TASKS}
        collected = {}
        for item in items:
            cuda = "cuda" in item.keywords
            if cuda:
                self._cuda_items.add(item.nodeid)
            collected[item.nodeid] = {
                "tasks": sorted(names[m.name] for m in item.iter_markers() if m.name in names),
                "cuda": cuda}
        self.emit(ev="collected", items=collected)

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.emit(ev="start", id=nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.emit(ev="report", id=report.nodeid, when=report.when, outcome="failed",
                      duration=report.duration, message=_first_failure_line(report))
        elif report.skipped:
            reason = _skip_reason(report)
            if report.nodeid in self._cuda_items and not self._cuda:
                self.emit(ev="report", id=report.nodeid, when=report.when,
                          outcome="cuda_skipped", duration=report.duration, message=reason)
            else:
                self.emit(ev="report", id=report.nodeid, when=report.when, outcome="failed",
                          duration=report.duration,
                          message=f"skipped ({reason}): a skipped test counts as failed")
        else:
            self.emit(ev="report", id=report.nodeid, when=report.when, outcome="passed",
                      duration=report.duration, message="")

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.emit(ev="finish", id=nodeid)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.emit(ev="done", exitstatus=int(exitstatus))
        self._file.close()


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _read_channel(fd: int) -> tuple[bytes, str]:
    """The grader's ``secret path`` line from pipe ``fd`` (then closed)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    secret, _, path = data.decode().strip().partition(" ")
    if not secret or not path:
        raise pytest.UsageError("--course-channel: the grader sent no secret and path")
    return secret.encode(), path


# ---------------------------------------------------------------- per-test timeout


class TestTimeout(Exception):
    """A test ran past ``--test-timeout`` seconds (raised inside it by SIGALRM)."""


def _on_alarm(signum, frame) -> None:
    raise TestTimeout(f"timed out: the test ran past {_TIMEOUT[0]:g} s (--test-timeout); an "
                      f"infinite loop or a hang in the code under test?")


_TIMEOUT = [0.0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Backstop for ``--test-timeout``: a hang inside C code never returns to Python, so
    faulthandler ends the whole process ``--test-timeout`` + 30 s into the test; the
    grader marks the running test failed and goes on in a fresh process."""
    timeout = _TIMEOUT[0]
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout + 30, exit=True)
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Bound each test's call by ``--test-timeout`` seconds: SIGALRM raises
    :class:`TestTimeout` inside the test, and again every 2 s after, so that a
    hypothesis replay of the hanging example is interrupted too."""
    timeout = _TIMEOUT[0]
    usable = timeout > 0 and hasattr(signal, "setitimer")
    if usable:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout, 2.0)
    try:
        yield
    finally:
        if usable:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, old)


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
