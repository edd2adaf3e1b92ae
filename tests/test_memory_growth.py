"""A long-running server's memory stays bounded (docs/serving.md, "Memory over time").

The soak's creeping RSS came from oneDNN, which keeps about half a megabyte for every
GEMM shape it compiles, for as long as the process lives: the prepacked GEMM's row
counts now go through ``packed_rows`` (a bounded set of buckets). Measured with
glibc's ``mallinfo2`` in a fresh process, against the raw oneDNN op fed the same row
counts (the control that shows the growth).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.fast import linear as fast_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch has no oneDNN")


@given(st.integers(1, fast_linear.PACKED_CHUNK_ROWS))
def test_packed_rows_round_up_a_little(m):
    p = fast_linear.packed_rows(m)
    assert m <= p <= fast_linear.PACKED_CHUNK_ROWS and p % 8 == 0
    assert p - m <= max(7, m // 8)


def test_packed_rows_are_few():
    rows = {fast_linear.packed_rows(m) for m in range(1, fast_linear.PACKED_CHUNK_ROWS + 1)}
    assert len(rows) <= 32  # a chunk's remainder can be any count from 1
    assert all(fast_linear.packed_rows(p) == p for p in rows)  # a bucket is its own bucket


@needs_onednn
@pytest.mark.parametrize("m", [17, 23, 127, 129, 255, 257, 511, 512, 513, 700])
def test_padded_gemm_matches_float64(m):
    """Rows that are padded (and those past PACKED_CHUNK_ROWS, on F.linear) give x W^T + b."""
    g = torch.Generator().manual_seed(m)
    n, k = 131, 72
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 1e3
    y = fast_linear.linear(x, w, b, packed=fast_linear.prepack_weight(w))
    expect = x.double() @ w.double().T + b.double()
    assert y.shape == (m, n)
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-2 * k ** 0.5)


_PROBE = textwrap.dedent("""
    import ctypes, sys
    import torch
    from minivllm.fast import linear as fast_linear

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    w = torch.randn(1728, 576)
    # "linear": the default copy (the panels, where the build has them); "raw" and
    # "onednn": oneDNN's, fed to its op directly or through the fast linear.
    packed = fast_linear.prepack_weight(w, panels=sys.argv[1] == "linear")

    def run(m):
        x = torch.randn(m, 576)
        if sys.argv[1] == "raw":
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        else:
            fast_linear.linear(x, w, packed=packed)

    for m in range(17, 1100, 3):  # warm-up: every bucket once
        run(m)
    before = libc.mallinfo2().uordblks
    for m in range(18, 1100, 3):  # row counts not seen before
        run(m)
    print((libc.mallinfo2().uordblks - before) / 2**20)
""")


def _growth_mb(kind: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    out = subprocess.run([sys.executable, "-c", _PROBE, kind], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@needs_onednn
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallinfo2 is glibc's")
def test_new_row_counts_do_not_grow_memory():
    raw = _growth_mb("raw")
    # 361 new shapes: oneDNN alone keeps tens of MB for them; in buckets all were seen.
    assert raw > 20, f"the control did not grow ({raw:.1f} MB): the probe measures nothing"
    for kind in ("onednn", "linear"):
        grown = _growth_mb(kind)
        assert grown < 5, f"fast linear ({kind}) grew by {grown:.1f} MB over seen buckets"
