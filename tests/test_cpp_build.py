"""minivllm's build lock (``minivllm.fast.cpp_build``) on real builds, killed and restarted.

torch's ``load_inline`` waits forever on a ``lock`` file that a killed build left
behind. Here a tiny real extension is compiled in a subprocess into a temporary
``TORCH_EXTENSIONS_DIR``, killed while the compiler runs (SIGKILL, then Ctrl-C's
SIGINT to the whole process group), and built again in a fresh process, which
must finish within a bound (a hang fails on the subprocess timeout instead of
hanging the suite). Without our lock around torch's, the restart after the
SIGKILL waits forever. The lock's own rules (a live holder named at once, the
wait bounded, a dead holder taken over) are checked on a real live and a real
dead process.

Run: ``pytest -q tests/test_cpp_build.py`` (one to two minutes: one full compile of
the tiny extension, which includes torch's headers, and two cut short).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minivllm.fast import cpp_build

ROOT = Path(__file__).resolve().parents[1]
#: Compilers whose process shows a build is really compiling (ninja's children).
COMPILERS = {"cc1plus", "cc1", "clang", "clang++", "c++", "g++", "gcc"}

# The build in a fresh process: the tiny extension, called on 0..4 (x -> 3x + 1).
BUILD = """
import sys
from minivllm.fast.cpp_build import load_inline
import torch
mod = load_inline(name=sys.argv[1], functions=["affine"], verbose=False, cpp_sources=[
    "torch::Tensor affine(const torch::Tensor& x) { return x * 3 + 1; }"])
print(mod.affine(torch.arange(5.0)).tolist())
"""

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None or shutil.which("ninja") is None or not Path("/proc").is_dir(),
    reason="needs a C++ compiler, ninja and /proc (to see the compiler run)")


def _session(sid: int) -> list[tuple[int, str]]:
    """``(pid, command name)`` of every live process in session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we looked
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append((int(stat.parent.name), name))
    return found


def _start_build(cache: Path, name: str) -> subprocess.Popen:
    # The compiler's own temporary files (cc*.s) into the test's folder: a compiler killed
    # mid-compile cannot delete them, and in /tmp they would outlive the test.
    tmp = cache / "compiler-tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONPATH": str(ROOT),
           "TMPDIR": str(tmp)}
    # Its own group, as a terminal's job is, and Ctrl-C not ignored: a shell starts a
    # background job (`nohup pytest ... &`) with SIGINT ignored, and that is inherited.
    return subprocess.Popen([sys.executable, "-c", BUILD, name], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_while_compiling(proc: subprocess.Popen, sig: int, bound: float = 240.0) -> str:
    """Wait until the build's compiler runs, send ``sig`` to its whole group, reap it all."""
    deadline = time.monotonic() + bound
    while not any(name in COMPILERS for _, name in _session(proc.pid)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the build never reached the compiler within {bound:.0f} s "
                        f"(rc {proc.returncode}); stderr:\n{err[-2000:]}")
        time.sleep(0.1)
    time.sleep(0.5)  # into the compile
    os.killpg(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        # ninja runs each compiler in a process group of its own (it stops them itself on
        # SIGINT); after a SIGKILL they are orphans still compiling: end them by pid.
        deadline = time.monotonic() + 30
        while (left := _session(proc.pid)) and time.monotonic() < deadline:
            if sig == signal.SIGKILL or time.monotonic() > deadline - 20:
                for pid, _ in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
    assert not _session(proc.pid), "the killed build's compiler is still running"
    return err


@pytest.mark.slow
@needs_compiler
def test_a_build_killed_then_interrupted_is_finished_by_the_next_run(tmp_path):
    """SIGKILL mid-compile leaves both locks; the next build takes them over and compiles;
    Ctrl-C (SIGINT to the group) mid-compile releases ours; the next build finishes."""
    name = "minivllm_lock_test"
    build_dir = tmp_path / name
    lock, torch_lock = build_dir / cpp_build.LOCK_NAME, build_dir / "lock"

    killed = _start_build(tmp_path, name)
    _kill_while_compiling(killed, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    # What a killed build leaves: torch's bare lock (torch alone waits on it forever) and ours.
    assert torch_lock.exists()
    assert json.loads(lock.read_text())["pid"] == killed.pid

    # Reaching the compiler at all means it took over both locks (else it would wait).
    interrupted = _start_build(tmp_path, name)
    err = _kill_while_compiling(interrupted, signal.SIGINT)
    assert interrupted.returncode != 0
    assert "KeyboardInterrupt" in err, err[-2000:]
    assert not lock.exists(), "an interrupted build must release its lock"

    final = _start_build(tmp_path, name)
    try:
        out, err = final.communicate(timeout=300)
    finally:
        if final.poll() is None:
            os.killpg(final.pid, signal.SIGKILL)
            final.communicate()
    assert final.returncode == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == str([3.0 * i + 1 for i in range(5)])
    assert not lock.exists() and not torch_lock.exists()


class _Stamped:
    """A stderr that remembers when each line was written."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass


def _holder(pid: int, started: float) -> str:
    return json.dumps({"pid": pid, "host": socket.gethostname(), "started": started})


def test_a_live_holder_is_named_at_once_and_the_wait_gives_up(tmp_path, monkeypatch):
    """A live holder: named (pid, host, since when, lock file) within a second; after the
    bound (here from ``MINIVLLM_BUILD_LOCK_TIMEOUT``) a TimeoutError says what to do."""
    stderr = _Stamped()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv(cpp_build.TIMEOUT_ENV, "1.5")
    lock = tmp_path / cpp_build.LOCK_NAME
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.time() - 42
        lock.write_text(_holder(live.pid, started))
        start = time.monotonic()
        with pytest.raises(TimeoutError) as error, cpp_build.build_lock(tmp_path):
            pytest.fail("the lock was taken from a live holder")
        waited = time.monotonic() - start
    finally:
        live.kill()
        live.wait()
    assert stderr.lines and stderr.lines[0][0] - start < 1.0
    said = stderr.lines[0][1]
    since = time.strftime("%H:%M:%S", time.localtime(started))
    for part in (f"process {live.pid}", socket.gethostname(), since, str(lock)):
        assert part in said, (part, said)
    assert 1.5 <= waited < 5.0
    message = str(error.value)
    for part in (f"process {live.pid}", str(lock), "delete", cpp_build.TIMEOUT_ENV):
        assert part in message, (part, message)
    assert json.loads(lock.read_text())["pid"] == live.pid  # a live holder's lock is kept


def test_the_bound_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(cpp_build.TIMEOUT_ENV, raising=False)
    assert cpp_build.lock_timeout() == cpp_build.DEFAULT_TIMEOUT_SECONDS
    monkeypatch.setenv(cpp_build.TIMEOUT_ENV, "12.5")
    assert cpp_build.lock_timeout() == 12.5
    for bad in ("-1", "ten", "nan"):
        monkeypatch.setenv(cpp_build.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=cpp_build.TIMEOUT_ENV):
            cpp_build.lock_timeout()


def test_build_lock_takes_over_a_dead_holder_and_waits_for_a_live_one(tmp_path):
    """A killed build's lock (and torch's beside it) is taken over at once; a live holder's
    is waited for until it ends; the lock records this process's pid, host, start."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    lock = tmp_path / cpp_build.LOCK_NAME
    lock.write_text(_holder(int(dead.stdout), 0))
    (tmp_path / "lock").write_text("")  # torch's, left by the same killed build
    assert cpp_build.lock_holder(lock) is None
    before = time.time()
    with cpp_build.build_lock(tmp_path, timeout=5):
        mine = json.loads(lock.read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
        assert before <= mine["started"] <= time.time()
        assert not (tmp_path / "lock").exists()
    assert not lock.exists()

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(_holder(live.pid, time.time()))
        got = threading.Event()

        def take():
            with cpp_build.build_lock(tmp_path, timeout=60):
                got.set()

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        time.sleep(1.0)
        assert not got.is_set()
    finally:
        live.kill()
        live.wait()
    assert got.wait(10)  # the holder died: the waiter takes over
    thread.join(10)
    assert not lock.exists()
