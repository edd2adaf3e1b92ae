"""The C++ kernels' thread team (``minivllm/fast/csrc/thread_team.h``).

``parallel_for`` must run every index of a loop exactly once, whatever the
length, grain and thread count; raise a chunk's error in the caller and serve
the next loop; serve two Python threads at once and a forked child; and, the
reason it exists, let the running threads take over the chunks of a thread that
is late (its core held by another process) instead of waiting for it. The last
is checked without a clock: the test op makes every helper sleep in each chunk
it takes, and the caller must then have run all but the chunks the helpers hold
(a fixed split, as OpenMP's, leaves the helpers' half to them). In the default
"adaptive" mode two such late jobs in a row send the next jobs to the caller
alone for a moment; the team's counters show it.

The kernels' results do not depend on how a loop is cut, so the team and
``at::parallel_for`` (``cpu_parallel_mode("openmp")``) give the same bits; the
kernels themselves are checked against float64 oracles in test_cpu_ops.py,
test_gemv.py and test_quantization.py, which run under the team.
Run: ``pytest -q tests/test_thread_team.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import make_batch  # a random paged batch on a NaN-poisoned cache

import minivllm.ref.attention as ref_attention
from minivllm.fast import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")


@contextlib.contextmanager
def parallel_mode(mode: str):
    old = cpu_ops.ops().cpu_parallel_mode(mode)
    try:
        yield
    finally:
        cpu_ops.ops().cpu_parallel_mode(old)


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def coverage(n: int, grain: int, **kw) -> tuple[torch.Tensor, int]:
    counts = torch.zeros(n, dtype=torch.int32)
    by_caller = cpu_ops.ops().parallel_for_coverage(counts, grain, **kw)
    return counts, by_caller


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 5000), grain=st.integers(1, 700), threads=st.sampled_from([1, 2, 3, 5]),
       mode=st.sampled_from(["adaptive", "team", "openmp", "steal"]), revocable=st.booleans())
def test_every_index_runs_exactly_once(n, grain, threads, mode, revocable):
    with num_threads(threads), parallel_mode(mode):
        counts, by_caller = coverage(n, grain, revocable=revocable)
    assert torch.equal(counts, torch.ones(n, dtype=torch.int32))
    assert 0 <= by_caller <= n


def test_a_late_helpers_revocable_chunk_is_taken_over_and_its_copy_dropped():
    """A revocable loop: helpers sleep 300 ms in each chunk before they write (a helper
    whose core another process holds). The caller takes their chunks over and returns
    with every index written once, by itself; the helpers, waking after the call is
    over, must write nothing, and the team must serve the next loops as usual."""
    import time

    with num_threads(3), parallel_mode("team"):
        stolen0 = cpu_ops.ops().cpu_team_stats()[3]
        n = 1200
        for _ in range(10):  # until a helper has claimed a chunk (it wakes in microseconds)
            coverage(n, 1)  # the helpers are awake
            # The caller sleeps 1 ms in each of its chunks: a helper claims one meanwhile.
            counts, by_caller = coverage(n, 1, helper_delay_us=300_000, caller_delay_us=1000,
                                         revocable=True)
            assert torch.equal(counts, torch.ones(n, dtype=torch.int32))
            assert by_caller == n  # the helpers' chunks too: the caller wrote them
            if cpu_ops.ops().cpu_team_stats()[3] > stolen0:
                break
        assert cpu_ops.ops().cpu_team_stats()[3] > stolen0
        for _ in range(20):  # the next loops, while the late helpers still sleep
            again, _ = coverage(777, 1, revocable=True)
            assert torch.equal(again, torch.ones(777, dtype=torch.int32))
        time.sleep(0.5)  # the helpers woke: their late copies were dropped
        assert torch.equal(counts, torch.ones(n, dtype=torch.int32))
        again, _ = coverage(n, 1)
        assert torch.equal(again, torch.ones(n, dtype=torch.int32))


@pytest.mark.parametrize("mode", ["team", "steal"])
def test_a_revocable_chunks_error_reaches_the_caller(mode):
    with num_threads(2), parallel_mode(mode):
        for throw_at in (0, 999, 1500):
            counts = torch.zeros(1501, dtype=torch.int32)
            with pytest.raises(RuntimeError, match=f"index {throw_at} raises"):
                cpu_ops.ops().parallel_for_coverage(counts, 1, throw_at, revocable=True)
            assert counts[throw_at] == 0
            counts, _ = coverage(1501, 1, revocable=True)
            assert torch.equal(counts, torch.ones(1501, dtype=torch.int32))


def test_a_late_helpers_chunks_are_taken_by_the_caller():
    """Helpers sleep 20 ms in every chunk they take: the caller runs the rest itself."""
    threads = 4
    with num_threads(threads), parallel_mode("team"):
        n = 4000
        counts, by_caller = coverage(n, 1, helper_delay_us=20_000)
        assert torch.equal(counts, torch.ones(n, dtype=torch.int32))
        chunk = -(-n // (threads * 4))  # CHUNKS_PER_THREAD = 4 in thread_team.h
        # Each helper can hold one chunk while the caller runs every other one.
        assert by_caller >= n - (threads - 1) * chunk, (by_caller, chunk)


def test_two_late_jobs_send_the_next_ones_to_the_caller_alone():
    """Adaptive mode: after two late jobs (a helper held a chunk 20 ms), the next job
    runs on the caller alone, unless the solo time (200 ms) has passed meanwhile."""
    import time

    with num_threads(2), parallel_mode("adaptive"):
        coverage(64, 1)
        team0, solo0, late0, _ = cpu_ops.ops().cpu_team_stats()
        # The helper (spinning after the last job) takes a chunk and holds it 20 ms,
        # while the caller runs the other 7 in 0.2 ms each and then waits for it.
        for _ in range(2):
            counts, _ = coverage(64, 1, helper_delay_us=20_000, caller_delay_us=200)
            assert torch.equal(counts, torch.ones(64, dtype=torch.int32))
        late_at = time.monotonic()
        counts, by_caller = coverage(64, 1)
        elapsed = time.monotonic() - late_at
        team1, solo1, late1, _ = cpu_ops.ops().cpu_team_stats()
        assert torch.equal(counts, torch.ones(64, dtype=torch.int32))
        if late1 - late0 >= 2 and elapsed < 0.2:
            assert solo1 == solo0 + 1 and by_caller == 64


def test_a_chunks_error_reaches_the_caller_and_the_team_serves_on():
    with num_threads(2), parallel_mode("team"):
        for throw_at in (0, 999, 1500):  # the caller's first chunk, a later one, the last
            counts = torch.zeros(1501, dtype=torch.int32)
            with pytest.raises(RuntimeError, match=f"index {throw_at} raises"):
                cpu_ops.ops().parallel_for_coverage(counts, 1, throw_at)
            assert counts[throw_at] == 0
            counts, _ = coverage(1501, 1)
            assert torch.equal(counts, torch.ones(1501, dtype=torch.int32))


def test_bad_mode_is_a_clear_error():
    with pytest.raises(RuntimeError, match="'adaptive', 'team', 'openmp' or 'steal'"):
        cpu_ops.ops().cpu_parallel_mode("tbb")
    assert cpu_ops.ops().cpu_parallel_mode("") in ("adaptive", "team", "openmp", "steal")


def test_two_python_threads_share_the_team():
    """A second caller while the team is busy runs its loop itself, in order."""
    errors = []

    def caller(n):
        try:
            for _ in range(300):
                counts, _ = coverage(n, 1)
                assert torch.equal(counts, torch.ones(n, dtype=torch.int32))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with num_threads(2), parallel_mode("team"):
        threads = [threading.Thread(target=caller, args=(n,)) for n in (513, 1000, 77)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)


def _child_coverage(q):
    counts = torch.zeros(3001, dtype=torch.int32)
    cpu_ops.ops().parallel_for_coverage(counts, 1)
    q.put(bool((counts == 1).all()))


@pytest.mark.skipif(sys.platform != "linux", reason="fork is Linux's")
def test_a_forked_child_makes_a_team_of_its_own():
    coverage(1000, 1)  # the parent's team exists
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child_coverage, args=(q,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in parallel_for")
    assert child.exitcode == 0 and q.get(timeout=5)


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "int8-w8a8", "int4-w4a8"])
def test_the_team_and_openmp_give_the_same_bits_with_a_core_busy(quantization):
    """A projection of awkward size, 2 and 3 rows, while another process holds a core:
    the team's result is at::parallel_for's, bit for bit (no output is split between
    chunks), and both are within float32 rounding of the textbook result (float64 for
    a float weight, the ref twin for a quantized one). "steal" (the caller reruns every
    revocable chunk a helper has not finished: the GEMV's and the W8A8 tiles') too."""
    from dataclasses import replace

    from minivllm.fast import quantization as fast_quant
    from minivllm.ref import quantization as ref_quant

    g = torch.Generator().manual_seed(7)
    n, k = 1003, 576
    w = torch.randn(n, k, generator=g)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for m in (1, 2, 3):
            x = torch.randn(m, k, generator=g)
            outs = {}
            for mode in ("team", "openmp", "steal"):
                with num_threads(2), parallel_mode(mode):
                    if quantization is None:
                        y = torch.empty(m, n)
                        cpu_ops.ops().linear_small_m(y, x, w, None, False)
                        oracle = x.double() @ w.double().T
                    else:
                        method, _, w8a8 = quantization.partition("-")
                        layer = ref_quant.quantize(w, method)
                        if w8a8:
                            layer = replace(layer, activations="int8")
                        y = fast_quant.quantized_linear(x, layer)
                        oracle = ref_quant.quantized_linear(x, layer)  # the textbook twin
                    outs[mode] = y
            assert torch.equal(outs["team"], outs["openmp"])
            assert torch.equal(outs["steal"], outs["openmp"])
            torch.testing.assert_close(outs["team"].double(), oracle.double(), rtol=1e-4, atol=1e-4)
    finally:
        busy.kill()
        busy.wait()


def test_resizing_the_team_never_hangs():
    """torch.set_num_threads between loops rebuilds the team; a helper that starts after
    its team was told to stop must still stop (a hang here is a failure, not a wait)."""
    script = (
        "import torch\n"
        "from minivllm.fast import cpu_ops\n"
        "ops = cpu_ops.ops()\n"
        "for i in range(400):\n"
        "    torch.set_num_threads(1 + i % 4)\n"
        "    c = torch.zeros(257, dtype=torch.int32)\n"
        "    ops.parallel_for_coverage(c, 1)\n"
        "    assert bool((c == 1).all())\n"
        "print('done')\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("parallel_for hung while the team was resized")
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 300), k=st.integers(1, 200),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_the_gemv_is_right_when_the_caller_takes_every_late_chunk_over(m, n, k, dtype, seed):
    """``linear_small_m`` is revocable: in mode "steal" the caller reruns every chunk a
    helper has not finished, and the helpers' copies are dropped. The result must be
    the team's bit for bit, and within rounding of the float64 product."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    want = (x.double() @ w.double().T)
    outs = {}
    with num_threads(3):
        for mode in ("team", "steal"):
            with parallel_mode(mode):
                outs[mode] = torch.empty(m, n, dtype=dtype)
                cpu_ops.ops().linear_small_m(outs[mode], x, w, None, False)
    assert torch.equal(outs["steal"], outs["team"])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs["steal"].double(), want, rtol=tol, atol=tol * (k ** 0.5))


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 10), st.integers(30, 260)).map(lambda t: (t[0], t[0] + t[1])),
                     min_size=1, max_size=4),
       heads=st.tuples(st.integers(1, 4), st.sampled_from([1, 3, 4])).map(lambda t: (t[0] * t[1], t[0])),
       head_dim=st.sampled_from([24, 64, 80]), block_size=st.sampled_from([1, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), gemm_prefill=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_is_right_when_the_caller_takes_every_late_chunk_over(
        seqs, heads, head_dim, block_size, dtype, gemm_prefill, seed):
    """``paged_attention`` without GEMM-tiled items (decodes, and short prefills or
    ``gemm_prefill=False``) is revocable: in mode "steal" the caller reruns every chunk
    a helper has not finished, and the helpers' staged outputs are dropped. A batch with
    tiled items is not, and must be right under "steal" too. Either way: the team's
    bits, and within rounding of the ref twin (on a NaN-poisoned cache)."""
    query, k_cache, v_cache, md, _ = make_batch(seqs, heads[0], heads[1], head_dim, block_size,
                                                dtype, seed)
    args = (k_cache, v_cache, md.block_tables.to(torch.int32), md.seq_lens.to(torch.int32),
            md.query_start_loc.to(torch.int32), head_dim**-0.5, gemm_prefill, None, None)
    outs = {}
    with num_threads(3):
        for mode in ("team", "steal"):
            with parallel_mode(mode):
                outs[mode] = torch.full_like(query, float("nan"))
                cpu_ops.ops().paged_attention(outs[mode], query, *args)
    assert torch.equal(outs["steal"], outs["team"])
    want = ref_attention.paged_attention(query, k_cache, v_cache, md, head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["steal"].float(), want.float(), rtol=tol, atol=tol)
