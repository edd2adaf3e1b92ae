"""Every C++ extension minivllm compiles goes through here: torch's JIT build under one lock.

What you learn here: why a just-in-time C++ build needs its own lock, and what a
lock file must record to be taken over safely.

``torch.utils.cpp_extension.load`` and ``load_inline`` take a bare ``lock`` file in
the extension's build folder (``$TORCH_EXTENSIONS_DIR/<name>/``) while they compile,
and every other process building the same extension waits, silently and forever,
while that file exists. A build killed part-way (Ctrl-C during a test run's
collection, a timeout's SIGKILL) leaves it behind, and the next run hangs in
``FileBaton.wait`` with no word of why.

So every build here (the C++ CPU ops, each course kernel task and a student's
``csrc/``, tutorial 07's op) is :func:`load` or :func:`load_inline`, which hold
:func:`build_lock`, a lock file of our own (``<build folder>/minivllm.lock``), around
torch's build:

- the lock file records its holder: pid, host and start time (written whole, then
  linked into place, so it is never seen half-written);
- a holder on this host whose process is gone is a killed build's: its lock is
  taken over at once, and torch's ``lock`` beside it, which can then only be that
  killed build's (every build holds ours around torch's), is removed;
- a live holder is waited for, and the wait is said at once: which process, on
  which host, since when, which file; after :func:`lock_timeout` seconds
  (``MINIVLLM_BUILD_LOCK_TIMEOUT``, default 1200) the wait gives up with a
  ``TimeoutError`` that says what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

#: Our lock's file name, in the extension's build folder (beside torch's ``lock``).
LOCK_NAME = "minivllm.lock"
#: The environment variable that bounds the wait for a live holder, in seconds.
TIMEOUT_ENV = "MINIVLLM_BUILD_LOCK_TIMEOUT"
#: The default bound, 20 minutes: a first build of the C++ ops takes a minute or two on an
#: idle machine, and was measured at 8 on two cores shared by six busy processes.
DEFAULT_TIMEOUT_SECONDS = 1200.0
#: Another host's lock (a shared home directory) cannot be checked for a live pid:
#: untouched this long, it is taken to be a killed build's.
STALE_LOCK_SECONDS = 600.0
#: An unreadable lock older than this is a writer's that died mid-write (older minivllm
#: versions wrote the file after creating it).
UNREADABLE_LOCK_SECONDS = 5.0
#: Seconds between two looks at a lock held by a live build.
LOCK_POLL_SECONDS = 0.2


def build_directory(name: str) -> Path:
    """The folder torch builds extension ``name`` in (``$TORCH_EXTENSIONS_DIR/<name>``)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def lock_timeout() -> float:
    """Seconds to wait for a live holder: ``$MINIVLLM_BUILD_LOCK_TIMEOUT``, default 1200."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also refuses nan
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill would signal a process group, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OverflowError:  # no such pid can exist
        return False
    return True


def _read(path: Path) -> dict | None:
    """The lock's holder as written, ``{}`` if unreadable, None if there is no lock."""
    try:
        holder = json.loads(path.read_text())
        return {"pid": int(holder["pid"]), "host": str(holder["host"]),
                "started": float(holder["started"])}
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OSError):
        return {}


def lock_holder(path: Path, seen: dict | None = None) -> dict | None:
    """``{"pid", "host", "started"}`` of the live build holding ``path``, or None if none does.

    ``seen``: the lock's content as already read (:func:`build_lock` judges the
    content it will take over, not a later one). A holder on this host whose
    process is gone is no holder: the lock is a killed build's. On another host
    the pid cannot be checked; a lock untouched for :data:`STALE_LOCK_SECONDS` is
    taken to be a killed build's there.
    """
    holder = _read(path) if seen is None else seen
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    if holder is None:
        return None
    if not holder:  # unreadable: a writer mid-write, or one that died there
        if age > UNREADABLE_LOCK_SECONDS:
            return None
        return {"pid": -1, "host": "?", "started": time.time() - age}
    if holder["host"] == socket.gethostname():
        return holder if _pid_alive(holder["pid"]) else None
    return holder if age <= STALE_LOCK_SECONDS else None


def _take_over(path: Path, dead: dict | None) -> None:
    """Remove a killed build's lock, unless another waiter has replaced it meanwhile."""
    tomb = path.with_name(f"{path.name}.dead.{_me()}")
    try:
        os.replace(path, tomb)  # atomic: of two waiters, one moves it
    except FileNotFoundError:
        return
    try:
        if (_read(tomb) or {}) != (dead or {}):  # a new holder's lock, taken since we looked
            with contextlib.suppress(FileExistsError):
                os.link(tomb, path)
    finally:
        tomb.unlink(missing_ok=True)


def _describe(holder: dict) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(holder["started"]))
    ago = max(0.0, time.time() - holder["started"])
    return f"process {holder['pid']} on {holder['host']} (building since {since}, {ago:.0f} s ago)"


def _me() -> str:
    """This process and thread, for temporary file names no other waiter uses."""
    return f"{os.getpid()}.{threading.get_ident()}"


def _write_lock(path: Path) -> dict | None:
    """Create ``path`` holding this process's pid, host and start time (returned); None if
    it exists."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    tmp = path.with_name(f"{path.name}.{_me()}.tmp")
    tmp.write_text(json.dumps(me))
    try:
        os.link(tmp, path)  # atomic, and fails if the lock exists
        return me
    except FileExistsError:
        return None
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def build_lock(build_dir: str | Path, timeout: float | None = None):
    """Hold ``build_dir/minivllm.lock`` while building; clear a killed build's locks first.

    Args:
        build_dir: the extension's build folder (it is created if missing).
        timeout: seconds to wait for a live holder before raising ``TimeoutError``;
            None reads :func:`lock_timeout`.

    A dead holder's lock (same host, pid gone) is taken over at once. Once ours is
    held, torch's ``lock`` in the same folder can only be a killed build's, and is
    removed. A live holder is named on stderr at once, then waited for.
    """
    build_dir = Path(build_dir)
    timeout = lock_timeout() if timeout is None else timeout
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / LOCK_NAME
    start, said = time.monotonic(), False
    while (me := _write_lock(path)) is None:
        seen = _read(path)
        holder = lock_holder(path, seen)
        if holder is None:
            _take_over(path, seen)
            continue
        if not said:
            print(f"minivllm: waiting for {_describe(holder)}; lock {path}; "
                  f"giving up after {timeout:.0f} s ({TIMEOUT_ENV})", file=sys.stderr, flush=True)
            said = True
        if time.monotonic() - start >= timeout:
            raise TimeoutError(
                f"gave up after {timeout:.0f} s waiting for {_describe(holder)}, which holds "
                f"{path}. If that process is no longer building (stuck, or its pid now belongs "
                f"to another program), stop it or delete {path}; to wait longer, set "
                f"{TIMEOUT_ENV} (seconds).")
        time.sleep(LOCK_POLL_SECONDS)
    try:
        torch_lock = build_dir / "lock"
        if torch_lock.exists():  # under our lock, no live build can hold it
            torch_lock.unlink(missing_ok=True)
            print(f"minivllm: removed {torch_lock}, left by a build that was stopped part-way",
                  file=sys.stderr, flush=True)
        yield
    finally:
        if _read(path) == me:  # ours still (never another's, should ours have been taken)
            path.unlink(missing_ok=True)


def load(name: str, sources: list[str], **kwargs):
    """``torch.utils.cpp_extension.load`` under :func:`build_lock` (same arguments)."""
    from torch.utils.cpp_extension import load as torch_load

    build_dir = kwargs.get("build_directory") or build_directory(name)
    with build_lock(build_dir):
        return torch_load(name=name, sources=sources, **kwargs)


def load_inline(name: str, cpp_sources, **kwargs):
    """``torch.utils.cpp_extension.load_inline`` under :func:`build_lock` (same arguments)."""
    from torch.utils.cpp_extension import load_inline as torch_load_inline

    build_dir = kwargs.get("build_directory") or build_directory(name)
    with build_lock(build_dir):
        return torch_load_inline(name=name, cpp_sources=cpp_sources, **kwargs)
