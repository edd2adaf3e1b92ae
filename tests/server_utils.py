"""Start and stop ``minivllm serve`` as a real subprocess for the server tests.

The server binds ``127.0.0.1`` on port 0 and prints its URL; :class:`ServerProcess`
reads it. ``stop()`` terminates (SIGTERM: uvicorn shuts down, the engine stops
its tensor-parallel workers), kills after a timeout, and checks that neither the
process, nor any child of it, nor the port is left behind.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from minivllm.backend import COMPONENTS


def server_backend(spec: str) -> str:
    """The backend a server under test runs (always on the CPU, see ServerProcess).

    The one under test, except that the fast Triton kernels would run in the
    (very slow) interpreter there, so ``fast`` becomes ``auto``: fast host-side
    components, ref kernels.
    """
    return "auto" if spec == "fast" else spec


def offline_backend(spec: str):
    """The same implementations as :func:`server_backend`, for an in-process oracle
    on the CPU: on a machine with CUDA, ``auto`` would pick the Triton kernels,
    which cannot take CPU tensors, so kernels are pinned to ref there."""
    spec = server_backend(spec)
    if spec != "auto" or not torch.cuda.is_available():
        return spec
    return {name: ("ref" if kind == "kernel" else "fast") for name, kind in COMPONENTS.items()}


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (read from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces; the parent pid is the 2nd field after ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: closed connections in TIME_WAIT do not count, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServerProcess:
    """``minivllm serve MODEL --port 0 ...`` in a subprocess; ``.base_url`` once up."""

    def __init__(self, model: str, *args: str, timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "minivllm.cli", "serve", model, "--host", "127.0.0.1",
               "--port", "0", "--device", "cpu", *args]
        # CUDA hidden: the server runs on the CPU, where "auto" means ref kernels.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop(check=False)
                raise RuntimeError(
                    f"server did not start in {timeout_s} s:\n{self.output()}") from None
            m = re.search(r"on (http://127\.0\.0\.1:(\d+))", line)
            if m:
                self.base_url, self.port = m.group(1), int(m.group(2))
                return
            if self.proc.poll() is not None and self.lines.empty():
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def output(self) -> str:
        return "".join(self.log[-40:])

    def workers(self) -> list[int]:
        """Pids of its tensor-parallel worker processes."""
        return [p for p in children(self.proc.pid) if "spawn_main" in cmdline(p)]

    def stop(self, check: bool = True, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; check nothing is left behind."""
        kids = children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [k for k in kids if alive(k)]
        for k in left:
            os.kill(k, signal.SIGKILL)
        if check:
            assert not left, f"server left child processes behind: {left}"
            assert port_is_free(self.port), f"port {self.port} is still bound"
