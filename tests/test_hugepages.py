"""``minivllm.fast.model_runner_hugepages.rehome``: weights moved into one huge-page-advised arena.

Moving must change nothing a model computes: every value, shape and stride is
kept, tensors that shared memory (a tied embedding and LM head, a quantized
weight's fields) still share it, small tensors stay where they are, and a second
call moves nothing. Every weight that moves, a 120 KB one too, lands in the one
arena, on a cache line, in the order the model holds them. Where huge pages are
off it moves nothing at all.
Run: ``pytest -q tests/test_hugepages.py``.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.fast import model_runner_hugepages as hugepages
from minivllm.ref import quantization as ref_quant


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1031, 600)  # 2.4 MB: moved
        self.head = torch.nn.Linear(600, 1031, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.randn(600))  # small: stays
        self.proj = torch.nn.Linear(100, 301, bias=False)  # 120 KB: moved too
        self.register_buffer("table", torch.randn(1100, 520)[:, 3:515])  # a strided view
        self.quant = torch.nn.Module()
        self.quant.weight = ref_quant.quantize(torch.randn(2304, 1024), "int8")  # 2.3 MB


@pytest.mark.skipif(not hugepages.huge_pages_available(), reason="no transparent huge pages here")
def test_rehome_keeps_values_views_and_sharing():
    torch.manual_seed(0)
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    qw = m.quant.weight
    q_before = (qw.qweight.clone(), qw.scales.clone())
    norm_ptr = m.norm.data_ptr()
    y_proj = m.proj(torch.ones(2, 100))
    strides = m.table.stride()
    x = torch.randint(0, 1031, (7,))
    y_before = m.head(m.embed(x))

    moved = hugepages.rehome(m)

    assert moved >= m.embed.weight.nbytes + qw.qweight.nbytes + m.proj.weight.nbytes
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(qw.qweight, q_before[0]) and torch.equal(qw.scales, q_before[1])
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()  # still tied
    assert m.embed.weight.data_ptr() % hugepages.HUGE_PAGE == 0  # the arena's start
    arena = m.embed.weight.untyped_storage().data_ptr()
    moved_tensors = [m.embed.weight, m.proj.weight, m.table, qw.qweight, qw.scales]
    assert all(t.untyped_storage().data_ptr() == arena for t in moved_tensors)
    starts = [m.embed.weight.data_ptr(), m.proj.weight.data_ptr(), qw.qweight.data_ptr()]
    assert starts == sorted(starts)  # the order the model holds them
    assert all((p - arena) % hugepages.ALIGN == 0 for p in starts)
    assert torch.equal(m.proj(torch.ones(2, 100)), y_proj)
    assert m.norm.data_ptr() == norm_ptr  # below min_bytes: not moved
    assert m.table.stride() == strides and not m.table.is_contiguous()
    assert torch.equal(m.head(m.embed(x)), y_before)
    assert isinstance(m.embed.weight, torch.nn.Parameter) and m.embed.weight.requires_grad
    assert hugepages.rehome(m) == 0  # once per model


def test_nothing_moves_where_huge_pages_are_off(monkeypatch):
    monkeypatch.setattr(hugepages, "huge_pages_available", lambda: False)
    m = Tied()
    ptr = m.embed.weight.data_ptr()
    assert hugepages.rehome(m) == 0 and m.embed.weight.data_ptr() == ptr
