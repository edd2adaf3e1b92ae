"""Ranks from a launcher: ``torchrun`` (env:// rendezvous) runs the same engine across processes.

Every multi-process test tags its processes through the environment (which
every descendant inherits; ``torchrun`` starts each rank in a session of its
own, out of reach of a process group), checks that no tagged process is left
once the command ended, and kills whatever is in ``finally``, so nothing
outlives a test. Rendezvous is on loopback; ``torchrun --standalone`` picks
its own free ports.

The linear layers are always the fast (one process per rank) twin: the ref
simulates every rank in one process, which a launcher cannot use. The kernels
are the ref's (quick to start, no compiler), the host-side components follow
``--backend``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

import minivllm
from minivllm import backend
from minivllm.backend import COMPONENTS
from minivllm.cli import build_parser
from minivllm.engine.config import EXECUTOR_BACKENDS
from minivllm.executor.launcher import choose_executor_backend, read_launcher_env

REPO = Path(minivllm.__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 240  # a whole torchrun command, start-up included, on a loaded 2-core machine


def spec() -> dict[str, str]:
    """Host-side components as selected, fast (real-rank) linear layers, ref kernels."""
    s = {name: backend.resolve(name) for name in COMPONENTS}
    s.update({name: "ref" for name, kind in COMPONENTS.items() if kind == "kernel"})
    s["linear"] = "fast"
    return s


# --------------------------------------------------------------------------
# The rule and its validation (no processes)
# --------------------------------------------------------------------------

LAUNCHED = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.mark.parametrize("requested,ranks,simulated,environ,expected", [
    (None, 1, False, {}, "uni"),
    (None, 2, True, {}, "uni"),  # the ref linear simulates both ranks
    (None, 2, False, {}, "mp"),
    (None, 2, False, LAUNCHED, "external_launcher"),  # torchrun's environment is enough
    ("mp", 2, False, LAUNCHED, "mp"),  # asked for by name: spawn, even under torchrun
    ("external_launcher", 1, False, {**LAUNCHED, "WORLD_SIZE": "1", "RANK": "0"}, "uni"),
])
def test_choose_executor_backend(requested, ranks, simulated, environ, expected) -> None:
    assert choose_executor_backend(requested, ranks, simulated, environ) == expected


def test_choose_executor_backend_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match=r"WORLD_SIZE \(the launcher's processes, here 2\) = "
                                         r"tensor_parallel_size x pipeline_parallel_size = 3"):
        choose_executor_backend(None, 3, False, LAUNCHED)
    with pytest.raises(ValueError, match="WORLD_SIZE.*here 1"):
        choose_executor_backend("external_launcher", 2, False, {})
    with pytest.raises(ValueError, match="simulate every rank"):
        choose_executor_backend("external_launcher", 2, True, LAUNCHED)
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be None .*'ray'"):
        choose_executor_backend("ray", 2, False, {})


@pytest.mark.parametrize("change,message", [
    ({"RANK": "2"}, r"RANK must be in \[0, 2\)"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be an int, got 'two'"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT must be in \[1, 65535\]"),
    ({"LOCAL_RANK": "3"}, r"LOCAL_RANK must be in \[0, 2\)"),
])
def test_launcher_env_is_checked(change, message) -> None:
    assert read_launcher_env(LAUNCHED).rank == 1
    with pytest.raises(ValueError, match=message):
        read_launcher_env({**LAUNCHED, **change})
    without = {k: v for k, v in LAUNCHED.items() if k != "RANK"}
    with pytest.raises(ValueError, match="did not set RANK"):
        read_launcher_env(without)


def test_engine_config_and_cli_validate_the_backend() -> None:
    from minivllm.engine.llm_engine import EngineConfig

    with pytest.raises(ValueError, match="distributed_executor_backend must be .*got 'torchrun'"):
        EngineConfig(distributed_executor_backend="torchrun")
    for value in EXECUTOR_BACKENDS:
        EngineConfig(distributed_executor_backend=value)
    parser = build_parser()
    for command in ("generate", "serve"):
        extra = ["hi"] if command == "generate" else []
        args = parser.parse_args([command, *extra, "--tensor-parallel-size", "2",
                                  "--pipeline-parallel-size", "3",
                                  "--distributed-executor-backend", "external_launcher"])
        assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
        assert args.distributed_executor_backend == "external_launcher"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--distributed-executor-backend", "ray"])


# --------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``MINIVLLM_TEST_TAG=tag``.

    ``torchrun`` starts every rank in a session of its own, so a process group
    cannot find them; the environment, which every descendant inherits, can.
    """
    needle = f"MINIVLLM_TEST_TAG={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):  # a zombie's environ is empty
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _left_behind(tag: str, grace_s: float = 10.0) -> list[int]:
    """The tagged processes still alive after ``grace_s`` (exiting ones get that long)."""
    deadline = time.monotonic() + grace_s
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _tagged(tag)


def _kill_tagged(tag: str) -> None:
    for pid in _tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def _scratch_in_tmp_path(tmp_path, monkeypatch) -> None:
    # torchrun makes a torchelastic_* folder under $TMPDIR per run and leaves it there:
    # make it one pytest removes.
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _env(tag: str, **extra: str) -> dict[str, str]:
    # The worktree's minivllm, unbuffered output, no GPU (these ranks are CPU ranks),
    # and a tag that finds every descendant.
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "", "MINIVLLM_TEST_TAG": tag, **extra}


def run_groups(cmds: list[list[str]], env: dict[str, str] | None = None,
               timeout_s: float = TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Run ``cmds`` at the same time (the nodes of a job); afterwards none of their
    processes, ranks included, may be left; whatever is left is killed."""
    tag = uuid.uuid4().hex
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_env(tag, **(env or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for cmd in cmds]
    results, deadline = [], time.monotonic() + timeout_s
    try:
        for cmd, proc in zip(cmds, procs):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
        left = _left_behind(tag)
    finally:
        _kill_tagged(tag)
        for proc in procs:
            proc.kill()
            proc.wait()
    assert not left, f"processes {left} were left behind:\n{results[-1].stderr[-3000:]}"
    return results


def run_group(cmd: list[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """:func:`run_groups` of one command."""
    return run_groups([cmd], timeout_s=timeout_s)[0]


LLM_SCRIPT = """
import json, sys
from minivllm import LLM, SamplingParams
model, spec, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tp, pp = int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, backend=spec, tensor_parallel_size=tp, pipeline_parallel_size=pp,
          dtype="float32", device="cpu", max_model_len=128, block_size=4,
          max_num_batched_tokens=16)
# Only rank 0 gets here: the other ranks serve it inside LLM(...) and exit with it.
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_torchrun_llm_matches_one_process_and_transformers(tiny_model_dir, tmp_path,
                                                           tp: int, pp: int) -> None:
    from test_engine import greedy, hf_greedy, make_llm, random_prompts

    # GQA: 4 query heads, 2 KV heads; 3 layers, which 2 stages split unevenly (2 + 1)
    path = tiny_model_dir("llama", num_hidden_layers=3)
    prompts = random_prompts(3, [5, 18, 1], seed=7)  # 18 tokens: a chunked prefill
    script = tmp_path / "run_llm.py"
    script.write_text(LLM_SCRIPT)
    result = run_group([*TORCHRUN, "--standalone", "--nproc-per-node", str(tp * pp),
                        str(script), str(path), json.dumps(spec()), json.dumps(prompts),
                        str(tp), str(pp)])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, result.stdout  # rank 1 never returned from LLM(...)
    got = json.loads(lines[0].split(" ", 1)[1])
    llm = make_llm(path, backend=spec(), block_size=4, max_num_batched_tokens=16,
                   max_model_len=128)
    try:
        one = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == one
    assert got == hf_greedy(path, prompts, 8)


@pytest.mark.slow
def test_two_node_commands_on_loopback_print_what_one_process_prints(tiny_model_dir,
                                                                      capsys) -> None:
    """The two-node command lines of docs/tensor_parallel.md, both "nodes" on this machine:
    ``torchrun --nnodes 2 --node-rank N --master-addr ... -m minivllm generate``, one
    pipeline stage per "node" (the layout for machines on a slow link)."""
    from minivllm.cli import main

    path = str(tiny_model_dir("llama"))
    # auto: the fast linear layers (one process per rank) and the C++ kernels where built.
    args = ["generate", "--model", path, "--backend", "auto", "--device", "cpu",
            "--dtype", "float32", "--max-tokens", "12", "Hello", "Bonjour"]
    port = str(_free_port())
    nodes = [[*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
              "--master-addr", "127.0.0.1", "--master-port", port, "-m", "minivllm", *args,
              "--pipeline-parallel-size", "2"] for node in (0, 1)]
    node0, node1 = run_groups(nodes, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr[-2000:] + node1.stderr[-2000:]
    assert main(args) == 0
    one = capsys.readouterr().out
    texts = lambda out: re.findall(r"### (.*?)\n(.*?)\n\n", out, re.S)  # noqa: E731
    assert len(texts(one)) == 2
    assert texts(node0.stdout) == texts(one)
    assert texts(node1.stdout) == []  # rank 1 served rank 0 and printed nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOP_SCRIPT = """
import json, sys
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], backend=json.loads(sys.argv[2]), tensor_parallel_size=2,
          dtype="float32", device="cpu", max_model_len=256, block_size=4,
          distributed_executor_backend="external_launcher")
print("READY", flush=True)
try:
    for _ in range(100_000):  # until the test kills a rank
        llm.generate({"prompt_token_ids": [1, 2, 3]},
                     SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
except RuntimeError as e:
    print("ERROR", e, flush=True)
    sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_dead_rank_is_an_error_not_a_hang(tiny_model_dir, tmp_path, victim: int) -> None:
    """Two ranks started by hand with the launcher's variables (any launcher, not just
    torchrun, whose agent would stop the survivors itself): kill one mid-generate.
    Rank 1 killed: rank 0's generate raises. Rank 0 killed: rank 1 exits by itself."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP_SCRIPT)
    port, tag = str(_free_port()), uuid.uuid4().hex
    procs = []
    try:
        for rank in (0, 1):
            env = _env(tag, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       MINIVLLM_TP_TIMEOUT_S="30")
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(tiny_model_dir("llama")), json.dumps(spec())],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        first = procs[0].stdout.readline()  # blocks until rank 0 is serving
        assert first.startswith("READY"), procs[0].communicate(timeout=30)
        time.sleep(1.0)  # in the middle of the generate loop
        os.kill(procs[victim].pid, signal.SIGKILL)
        start = time.monotonic()
        survivor = procs[1 - victim]
        out, err = survivor.communicate(timeout=90)
        elapsed = time.monotonic() - start
        left = _left_behind(tag)
    finally:
        _kill_tagged(tag)
        for p in procs:
            p.kill()
            p.wait()
    assert not left, f"processes {left} were left behind"
    assert elapsed < 60, f"the surviving rank took {elapsed:.1f} s to notice"
    if victim == 1:
        assert survivor.returncode == 3, err[-3000:]
        assert "ERROR a rank of the launched group (2 ranks) died or left" in out
    else:
        assert survivor.returncode == 1, err[-3000:]
        assert "minivllm: rank 1 lost the group" in err


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_torchrun_minivllm_serve(tiny_model_dir, flag: str) -> None:
    """``torchrun ... -m minivllm serve --tensor-parallel-size 2`` (or pipeline): rank 0 serves HTTP and
    answers as one process does; Ctrl-C (SIGINT to torchrun, which passes it on to its
    ranks) stops every rank, frees the port, and leaves nothing behind."""
    pytest.importorskip("uvicorn")
    from server_utils import port_is_free

    from minivllm import LLM, SamplingParams

    path = str(tiny_model_dir("llama"))
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "minivllm", "serve", path,
           "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--dtype", "float32",
           "--backend", "auto", "--max-model-len", "128", flag, "2"]
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log: list[str] = []
    url: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m and not url:
                url.append(m.group(1))
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert found.wait(TIMEOUT_S), "".join(log[-40:])
        body = json.dumps({"model": path, "prompt": "Hello", "max_tokens": 5,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{url[0]}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        left = _left_behind(tag)
    finally:
        _kill_tagged(tag)
        proc.kill()
        proc.wait()
    assert not left, "".join(log[-40:])
    assert port_is_free(int(url[0].rsplit(":", 1)[1]))
    assert "lost the group" not in "".join(log)  # rank 1 was shut down, not orphaned
    llm = LLM(path, backend="auto", dtype="float32", device="cpu", max_model_len=128)
    try:
        one = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["choices"][0]["text"] == one.text
