"""The grader's pytest child: how it is started, heard and stopped.

The child gets a secret and a report file's name through a pipe, only once
it runs, and tags each event it writes with the secret (see
:mod:`minivllm.course.grade`, step 2); lines with a bad tag are counted as
forged. It leads a process group of its own, which is killed when the child
is done, times out, or the grader is stopped, so that nothing a submission
starts (rank processes, a server, a stray ``sleep``) outlives the grading.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import signal
import subprocess
from pathlib import Path

#: The children running now (the grader may run several, on threads: ``selfcheck --jobs``).
_LIVE: set[subprocess.Popen] = set()


def _read_events(path: Path, secret: bytes) -> tuple[list[dict], int]:
    """The child's events, in order, and how many lines had a bad tag (forged)."""
    events, forged = [], 0
    if not path.exists():
        return events, forged
    for line in path.read_text(errors="replace").splitlines():
        tag, _, body = line.partition(" ")
        good = hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(tag, good):
            forged += 1
            continue
        events.append(json.loads(body))
    return events, forged


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group: the child, if it still runs, and whatever it
    started (a student's rank processes, a server, a stray ``sleep``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_all() -> None:
    """Kill every running child's process group (the grader is being stopped)."""
    for proc in list(_LIVE):
        _kill_group(proc)


def run_child(cmd: list[str], env: dict, cwd: Path, tmp: Path, hard_timeout: float):
    """One pytest child: returns (its events, forged lines, its output, killed?).

    The child leads a process group of its own, and the group is killed when
    the child is done, times out, or the grader itself is stopped (Ctrl-C,
    SIGTERM: see :func:`minivllm.course.cli.main`): no process it started
    outlives the grading.
    """
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(cmd + [f"--course-channel={read_fd}"], cwd=cwd, env=env,
                            pass_fds=(read_fd,), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _LIVE.add(proc)
    os.close(read_fd)
    # Only now, with the child running, make up the secret and the file's name.
    secret = secrets.token_hex(32)
    report = tmp / f"report-{secrets.token_hex(12)}.jsonl"
    os.write(write_fd, f"{secret} {report}\n".encode())
    os.close(write_fd)
    killed = False
    try:
        output, _ = proc.communicate(timeout=hard_timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        killed = True
    finally:
        _kill_group(proc)
        _LIVE.discard(proc)
    events, forged = _read_events(report, secret.encode())
    return events, forged, output or "", killed
