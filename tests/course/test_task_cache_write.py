"""Course task: writing K/V into the paged cache, including slot 0 and the last slot."""

from __future__ import annotations

import torch
from kernel_utils import DEVICE

from minivllm import backend


def test_first_and_last_slots_and_padding():
    num_blocks, block_size, heads, dim = 3, 4, 2, 8
    key = torch.randn(4, heads, dim)
    value = torch.randn(4, heads, dim)
    slots = torch.tensor([0, -1, num_blocks * block_size - 1, 5])
    shape = (num_blocks, block_size, heads, dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    dev = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots)]
    backend.get("cache_write").reshape_and_cache(*dev)
    k_out, v_out = dev[2].cpu().view(-1, heads, dim), dev[3].cpu().view(-1, heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_out[slot], key[t]), f"token {t}: key not at slot {slot}"
            assert torch.equal(v_out[slot], value[t]), f"token {t}: value not at slot {slot}"
    untouched = [s for s in range(num_blocks * block_size) if s not in slots.tolist()]
    assert torch.isnan(k_out[untouched]).all(), "a slot nobody writes was written (padding row?)"
