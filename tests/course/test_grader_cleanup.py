"""The grader leaves no process behind: not when it is stopped (SIGTERM, Ctrl-C) while a
submission hangs, and not when a submission starts a process of its own and forgets it.

The submission here is a real package graded by a real ``minivllm course grade``
process: its ``BlockAllocator`` starts a child process (standing in for a student's
rank process or server), writes that child's pid down, and hangs. Run:
``pytest -q tests/course/test_grader_cleanup.py --backend=ref``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from server_utils import alive, children

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ref_only(backend_spec):
    if backend_spec != "ref":
        pytest.skip("checks the course kit, not the backend: runs once, under --backend=ref")


def _hanging_package(root: Path, mark: Path) -> None:
    pkg = root / "hangpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "block_allocator.py").write_text(textwrap.dedent(f"""
        import subprocess
        import sys
        import time
        from pathlib import Path

        MARK = Path({str(mark)!r})


        class BlockAllocator:
            def __init__(self, *args, **kwargs):
                if not MARK.exists():  # the first test: start a process, then hang
                    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
                    MARK.write_text(str(p.pid))
                    time.sleep(300)
                raise NotImplementedError

            def allocate(self, *args):
                raise NotImplementedError

            free = touch = allocate
    """))


def _grade(root: Path, timeout_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minivllm.cli", "course", "grade", "--backend", "hangpkg",
           "--task", "allocator", "--path", str(root), "--timeout", str(timeout_s)]
    # Ctrl-C not ignored, as from a terminal: a shell starts a background job (`nohup
    # pytest ... &`) with SIGINT ignored, and a grader started from it would inherit that.
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(mark: Path, grader: subprocess.Popen, timeout_s: float = 180) -> int:
    deadline = time.monotonic() + timeout_s
    while not (mark.exists() and mark.read_text()):
        assert grader.poll() is None, grader.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the submission's test never started"
        time.sleep(0.2)
    return int(mark.read_text())


def _all_gone(pids: list[int], timeout_s: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_grader_stops_its_children_and_theirs(ref_only, tmp_path, sig):
    mark = tmp_path / "sleeper.pid"
    _hanging_package(tmp_path, mark)
    grader = _grade(tmp_path, timeout_s=600)
    try:
        sleeper = _wait_for(mark, grader)
        pytest_child = children(grader.pid)
        assert pytest_child and alive(sleeper)
        sent = time.monotonic()
        grader.send_signal(sig)
        grader.wait(30)
        assert time.monotonic() - sent < 30
        assert grader.returncode != 0
        assert not _all_gone([sleeper, *pytest_child]), "the grader left processes behind"
    finally:
        if grader.poll() is None:
            grader.kill()
            grader.wait(10)


def test_a_process_a_submission_forgets_ends_with_its_grading(ref_only, tmp_path):
    """The hanging test times out (--timeout 3), the others fail fast, the grade is
    printed: and the process the submission started is gone with its pytest child."""
    mark = tmp_path / "sleeper.pid"
    _hanging_package(tmp_path, mark)
    grader = _grade(tmp_path, timeout_s=3)
    try:
        output, _ = grader.communicate(timeout=300)
        assert grader.returncode == 1, output[-3000:]  # graded, not full marks
        assert "score:" in output
        sleeper = int(mark.read_text())
        assert not _all_gone([sleeper]), "the submission's process outlived the grading"
    finally:
        if grader.poll() is None:
            grader.kill()
            grader.wait(10)
