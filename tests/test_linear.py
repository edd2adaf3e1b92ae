"""Tensor-parallel linear layers == the dense layer (plain ``F.linear`` / ``F.embedding``).

The implementation under test is ``backend.get("linear")``:

- a simulating module (``SIMULATES_ALL_RANKS``, the ref) runs every rank in
  this process and must return exactly the dense layer's output, for
  ``tp_size`` in {1, 2, 4};
- a real one (the fast twin) runs in two gloo worker processes (one pool for
  the whole module: spawning costs seconds) and each rank's output must be
  the slice of the dense output that vLLM's layout gives that rank (checked
  here by :func:`expected_on_rank`, written independently of the layers).

Uneven splits must raise a ``ValueError`` listing the tp sizes that work.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import queue
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from minivllm import backend

linear = backend.get("linear")
SIMULATED = bool(getattr(linear, "SIMULATES_ALL_RANKS", False))
TP_SIZES = [1, 2, 4] if SIMULATED else [1, 2]  # the pool has two processes
POOL_SIZE = 2

# --------------------------------------------------------------------------
# Cases: a layer spec, its full (dense) weights and an input
# --------------------------------------------------------------------------

#: The yes/no choices a case makes, one per field (each used by some kinds only):
#: ``gather_output`` (column: all-gather the output), ``kv_divides`` (qkv: the KV
#: heads are a multiple of tp, else fewer and replicated), ``fused_load`` (merged,
#: qkv: load the fused checkpoint tensor with ``shard_id=None``, else one tensor
#: per sub-layer), ``full_input`` (row: ``input_is_parallel=False``).
CASE_SWITCHES = ("gather_output", "kv_divides", "fused_load", "full_input")


def make_case(kind: str, tp: int, k: dict[str, int], bias: bool, seed: int) -> dict[str, Any]:
    """A random case whose split sizes are multiples of ``tp`` (``k`` = per-rank counts)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    T, d_in = k["tokens"], k["in"]
    case: dict[str, Any] = {"kind": kind, "tp": tp, "bias": bias,
                            **{name: bool(k[name]) for name in CASE_SWITCHES}}
    if kind == "column":
        n = tp * k["out"]
        case.update(sizes=(d_in, n), w=rand(n, d_in), b=rand(n), x=rand(T, d_in))
    elif kind == "merged":
        outs = [tp * k["out"], tp * k["out2"]]
        case.update(sizes=(d_in, outs), w=[rand(o, d_in) for o in outs],
                    b=[rand(o) for o in outs], x=rand(T, d_in))
    elif kind == "qkv":
        # kv heads: either a multiple of tp, or a divisor of tp (replicated)
        n_kv = tp * k["kv"] if k["kv_divides"] else max(1, tp // 2 ** (k["kv"] % 3))
        n_q = n_kv * k["group"] * max(1, tp // n_kv)
        D = k["head"]
        case.update(sizes=(d_in, D, n_q, n_kv), w=[rand(n_q * D, d_in), rand(n_kv * D, d_in),
                                                   rand(n_kv * D, d_in)],
                    b=[rand(n_q * D), rand(n_kv * D), rand(n_kv * D)], x=rand(T, d_in))
    elif kind == "row":
        n_in = tp * k["out"]
        case.update(sizes=(n_in, d_in), w=rand(d_in, n_in), b=rand(d_in), x=rand(T, n_in))
    elif kind in ("embedding", "lm_head"):
        vocab = k["vocab"]  # any size: the vocabulary is padded
        case.update(sizes=(vocab, d_in), w=rand(vocab, d_in), b=rand(vocab))
        if kind == "embedding":
            ids = torch.randint(0, vocab, (T,), generator=g)
            ids[0], ids[-1] = vocab - 1, 0  # the last real row sits next to the padding
            case["x"] = ids
        else:
            case["x"] = rand(T, d_in)
    return case


def dense(case: dict[str, Any]) -> torch.Tensor:
    """The oracle: the layer with its whole weight, in plain torch."""
    w, b, x, kind = case["w"], case["b"] if case["bias"] else None, case["x"], case["kind"]
    if kind in ("merged", "qkv"):
        w, b = torch.cat(w), (torch.cat(b) if b is not None else None)
    if kind == "embedding":
        return F.embedding(x, w)
    return F.linear(x, w, b)


def expected_on_rank(case: dict[str, Any], full: torch.Tensor, rank: int) -> torch.Tensor | None:
    """What rank ``rank`` must hold after a real (one process per rank) layer."""
    tp, kind = case["tp"], case["kind"]

    def part(t: torch.Tensor, n: int) -> torch.Tensor:  # rank's 1/tp slice of the last dim
        return t[..., rank * n // tp : (rank + 1) * n // tp]

    if kind == "column":
        return full if case["gather_output"] else part(full, full.shape[-1])
    if kind == "merged":
        return torch.cat([part(p, p.shape[-1]) for p in full.split(case["sizes"][1], -1)], -1)
    if kind == "qkv":
        _, D, n_q, n_kv = case["sizes"]
        q, k, v = full.split([n_q * D, n_kv * D, n_kv * D], -1)
        if tp <= n_kv:
            return torch.cat([part(q, n_q * D), part(k, n_kv * D), part(v, n_kv * D)], -1)
        head = rank // (tp // n_kv)  # each KV head is replicated on tp / n_kv ranks
        kv = slice(head * D, (head + 1) * D)
        return torch.cat([part(q, n_q * D), k[..., kv], v[..., kv]], -1)
    return full  # row, embedding: all-reduced; lm_head: all-gathered; the same on every rank


# --------------------------------------------------------------------------
# Building and running a layer (in this process, or in a pool worker)
# --------------------------------------------------------------------------


def build_and_run(mod: Any, case: dict[str, Any], rank: int) -> torch.Tensor | None:
    """Build ``case``'s layer from ``mod``, load the FULL weights, run the forward."""
    kind, tp, bias = case["kind"], case["tp"], case["bias"]
    x = case["x"]
    if kind == "column":
        layer = mod.ColumnParallelLinear(*case["sizes"], bias=bias,
                                         gather_output=case["gather_output"], tp_size=tp)
        layer.weight.weight_loader(layer.weight, case["w"])
        if bias:
            layer.bias.weight_loader(layer.bias, case["b"])
    elif kind in ("merged", "qkv"):
        if kind == "merged":
            layer = mod.MergedColumnParallelLinear(*case["sizes"], bias=bias, tp_size=tp)
            ids: list[Any] = [0, 1]
        else:
            layer = mod.QKVParallelLinear(*case["sizes"], bias=bias, tp_size=tp)
            ids = ["q", "k", "v"]
        params = [(layer.weight, case["w"])] + ([(layer.bias, case["b"])] if bias else [])
        for param, pieces in params:
            if case["fused_load"]:  # the fused tensor at once (shard_id=None)
                param.weight_loader(param, torch.cat(pieces))
            else:  # one checkpoint tensor per sub-layer
                for shard_id, piece in zip(ids, pieces):
                    param.weight_loader(param, piece, shard_id)
    elif kind == "row":
        layer = mod.RowParallelLinear(*case["sizes"], bias=bias,
                                      input_is_parallel=not case["full_input"], tp_size=tp)
        layer.weight.weight_loader(layer.weight, case["w"])
        if bias:
            layer.bias.weight_loader(layer.bias, case["b"])
        if not case["full_input"] and not getattr(mod, "SIMULATES_ALL_RANKS", False):
            n = x.shape[-1] // tp
            x = x[..., rank * n : (rank + 1) * n]  # what the column layer before left here
    elif kind == "embedding":
        layer = mod.VocabParallelEmbedding(*case["sizes"], tp_size=tp)
        layer.weight.weight_loader(layer.weight, case["w"])
    else:
        layer = mod.ParallelLMHead(*case["sizes"], bias=bias, tp_size=tp)
        layer.weight.weight_loader(layer.weight, case["w"])
        if bias:
            layer.bias.weight_loader(layer.bias, case["b"])
    with torch.inference_mode():
        return layer(x)


def _pool_worker(rank: int, port: int, module: str, inbox: Any, outbox: Any) -> None:
    """One rank of the test pool: run every case it is sent, send back its output."""
    from minivllm import distributed

    torch.set_num_threads(1)
    distributed.init_distributed(rank, POOL_SIZE, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
    mod = importlib.import_module(module)
    while (case := inbox.get()) is not None:
        try:
            outbox.put((rank, build_and_run(mod, case, rank), None))
        except Exception:
            outbox.put((rank, None, traceback.format_exc()))
    distributed.destroy_distributed()


class Pool:
    """Two gloo processes that run the same case together (one per rank)."""

    def __init__(self, module: str) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.inboxes = [ctx.Queue() for _ in range(POOL_SIZE)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(target=_pool_worker, args=(r, port, module, self.inboxes[r], self.outbox),
                        daemon=True)
            for r in range(POOL_SIZE)
        ]
        for p in self.procs:
            p.start()

    def run(self, case: dict[str, Any]) -> list[torch.Tensor | None]:
        """Every rank's output for ``case`` (tp must equal the pool size)."""
        for box in self.inboxes:
            box.put(case)
        outputs: list[Any] = [None] * POOL_SIZE
        errors = []
        for _ in range(POOL_SIZE):  # read every answer, so none is left for the next case
            try:
                rank, out, err = self.outbox.get(timeout=120)
            except queue.Empty:
                raise AssertionError("a tensor-parallel test worker did not answer") from None
            if err is not None:
                errors.append(f"rank {rank} raised:\n{err}")
            outputs[rank] = out
        if errors:
            raise AssertionError("\n".join(errors))
        return outputs

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def pool() -> Any:
    if SIMULATED:
        yield None
        return
    p = Pool(linear.__name__)
    yield p
    p.close()


def check(case: dict[str, Any], pool: Pool | None) -> None:
    """Run ``case`` on the implementation under test and compare with the dense oracle."""
    full = dense(case)
    if SIMULATED or case["tp"] == 1:
        outputs = [build_and_run(linear, case, rank=0)]
        expected = [full] if SIMULATED else [expected_on_rank(case, full, 0)]
    else:
        outputs = pool.run(case)
        expected = [expected_on_rank(case, full, r) for r in range(case["tp"])]
    for rank, (out, exp) in enumerate(zip(outputs, expected)):
        assert out.shape == exp.shape, f"rank {rank}: shape {tuple(out.shape)} != {tuple(exp.shape)}"
        torch.testing.assert_close(out, exp, atol=1e-4, rtol=1e-4, msg=lambda m, r=rank: f"rank {r}: {m}")


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------

sizes = st.fixed_dictionaries({
    "tokens": st.integers(1, 9), "in": st.integers(1, 37), "out": st.integers(1, 7),
    "out2": st.integers(1, 5), "kv": st.integers(1, 3), "group": st.integers(1, 3),
    "head": st.sampled_from([1, 3, 8]), "vocab": st.integers(1, 53),
    **{name: st.booleans() for name in CASE_SWITCHES},
})
KINDS = ["column", "merged", "qkv", "row", "embedding", "lm_head"]


@given(kind=st.sampled_from(KINDS), tp=st.sampled_from(TP_SIZES), k=sizes, bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_parallel_layer_matches_dense(kind: str, tp: int, k: dict[str, int], bias: bool,
                                      seed: int, pool: Any) -> None:
    if kind == "embedding":
        bias = False
    check(make_case(kind, tp, k, bias, seed), pool)


@pytest.mark.parametrize("kind", KINDS)
def test_every_layer_at_the_pool_size(kind: str, pool: Any) -> None:
    """Each layer at least once with real sharding (hypothesis may not draw every pair)."""
    k = dict(tokens=5, **{"in": 13}, out=3, out2=2, kv=1, group=2, head=3, vocab=29,
             **dict.fromkeys(CASE_SWITCHES, False))
    tp = 4 if SIMULATED else POOL_SIZE
    check(make_case(kind, tp, k, bias=kind != "embedding", seed=7), pool)
    if kind == "qkv":  # and with every KV head replicated (1 KV head, tp ranks)
        check(make_case(kind, tp, dict(k, kv=2), bias=True, seed=8), pool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@given(n=st.integers(1, 40), tp=st.integers(2, 8))
def test_uneven_split_is_refused_with_the_sizes_that_work(n: int, tp: int) -> None:
    assume(n % tp != 0)
    ok = str(_divisors(n))
    with pytest.raises(ValueError, match="tp sizes that work") as e:
        linear.ColumnParallelLinear(4, n, tp_size=tp)
    assert ok in str(e.value)
    with pytest.raises(ValueError, match="tp sizes that work") as e:
        linear.RowParallelLinear(n, 4, tp_size=tp)
    assert ok in str(e.value)
    with pytest.raises(ValueError, match="tp sizes that work"):
        linear.MergedColumnParallelLinear(4, [tp, n], tp_size=tp)


def test_qkv_refuses_uneven_heads() -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads. tp=3: 3 q + 1 kv each; tp=9: KV replicated.
    with pytest.raises(ValueError, match=r"\[1, 3, 9\]"):
        linear.QKVParallelLinear(72, 8, 9, 3, tp_size=2)
    # 8 query heads, 3 KV heads: tp=2 splits q but not kv, and 2 is no multiple of 3.
    with pytest.raises(ValueError, match=r"tp sizes that work: \[1\]"):
        linear.QKVParallelLinear(64, 8, 8, 3, tp_size=2)
    for tp in (1, 3, 9):
        layer = linear.QKVParallelLinear(72, 8, 9, 3, tp_size=tp)
        per_rank = 9 // tp if not SIMULATED else 9
        assert layer.num_heads == per_rank


def test_bad_checkpoint_shape_is_refused() -> None:
    layer = linear.ColumnParallelLinear(6, 4, tp_size=1)
    with pytest.raises(ValueError, match="shape"):
        layer.weight.weight_loader(layer.weight, torch.zeros(4, 7))
    with pytest.raises(ValueError, match="tp_size"):
        linear.ColumnParallelLinear(6, 4, tp_size=0)


def test_tied_embedding_and_lm_head_share_a_layout() -> None:
    """``lm_head.weight = embed.weight`` (tie_word_embeddings) must give the dense logits."""
    if not SIMULATED:
        pytest.skip("needs every rank in one process (the ref simulation)")
    vocab, dim, tp = 23, 6, 4
    w = torch.randn(vocab, dim)
    embed = linear.VocabParallelEmbedding(vocab, dim, tp_size=tp)
    head = linear.ParallelLMHead(vocab, dim, tp_size=tp)
    head.weight = embed.weight
    embed.weight.weight_loader(embed.weight, w)
    h = torch.randn(3, dim)
    torch.testing.assert_close(head(h), h @ w.T)


@pytest.mark.parametrize("kind", KINDS)
def test_twins_contracts(kind: str) -> None:
    """The twins' behaviour, not just their names: at tp=1 both are the dense layer,
    output for output; at tp=2 the fast layer (rank 0 here, without a process group)
    holds exactly rank 0's part of the ref's dense output, and their head counts
    differ as both files document (ref: totals; fast: this rank's)."""
    import minivllm.fast.linear as fast
    import minivllm.ref.linear as ref

    k = dict(tokens=4, **{"in": 11}, out=3, out2=2, kv=1, group=2, head=3, vocab=17,
             **dict.fromkeys(CASE_SWITCHES, False))
    case = make_case(kind, 1, k, bias=kind != "embedding", seed=11)
    # A lookup is exact; a matmul of these 4 rows is the fast twin's C++ GEMV, which
    # sums in another order than MKL: float32's default closeness, not bit equality.
    exact = dict(rtol=0, atol=0) if kind == "embedding" else {}
    torch.testing.assert_close(build_and_run(fast, case, 0), build_and_run(ref, case, 0),
                               **exact)
    if kind not in ("column", "merged", "qkv"):
        return  # the others communicate in forward: covered by the pool above
    case = make_case(kind, 2, dict(k, kv_divides=True), bias=True, seed=12)
    dense_out = build_and_run(ref, case, 0)
    torch.testing.assert_close(dense_out, dense(case), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(build_and_run(fast, case, 0),
                               expected_on_rank(case, dense_out, 0), atol=1e-5, rtol=1e-5)
    if kind == "qkv":
        _, D, n_q, n_kv = case["sizes"]
        r, f = ref.QKVParallelLinear(*case["sizes"], tp_size=2), fast.QKVParallelLinear(
            *case["sizes"], tp_size=2)
        assert (r.num_heads, r.num_kv_heads) == (n_q, n_kv)
        assert (f.num_heads, f.num_kv_heads) == (n_q // 2, n_kv // 2)
