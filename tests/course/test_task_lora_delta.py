"""Course task: the LoRA delta for a batch of mixed adapters, against the formula by hand.

Small cases whose answers are written out: one token and rank 1 (a number you can
check on paper), a token with no adapter, slices of a fused output, each slot's own
scaling, a lower-rank adapter zero-padded in its slot.
"""

from __future__ import annotations

import torch

from minivllm import backend
from minivllm.lora.mapping import LoRAMapping


def add_lora(y, x, lora_a, lora_b, scalings, token_slots, output_slices):
    backend.get("lora").add_lora(y, x, lora_a, lora_b, scalings, LoRAMapping.build(token_slots),
                                 output_slices)
    return y


def test_one_token_rank_one_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    a = torch.tensor([[[0.5, 0.0, -1.0]]])  # (1 slot, rank 1, in 3): x . a = 0.5 - 3 = -2.5
    b = torch.tensor([[[2.0, -4.0]]])  # (1 slot, rank 1, out 2): B^T's only row
    y = add_lora(torch.tensor([[10.0, 20.0]]), x, [a], [b], [torch.tensor([0.5])], [0], [2])
    torch.testing.assert_close(y, torch.tensor([[10.0 + 0.5 * -2.5 * 2.0, 20.0 + 0.5 * -2.5 * -4.0]]),
                               msg="y += scale * (x A^T) B^T, with lora_b holding B^T")


def test_token_without_adapter_is_untouched_even_with_a_last_slot():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 5, generator=g)
    x, y = torch.randn(3, 6, generator=g), torch.randn(3, 5, generator=g)
    out = add_lora(y.clone(), x, [a], [b], [torch.ones(3)], [1, -1, 1], [5])
    assert torch.equal(out[1], y[1]), "slot -1 means no adapter: y[1] must not change " \
                                      "(a[-1] is the LAST slot, not 'no adapter')"
    assert not torch.equal(out[0], y[0])


def test_each_slice_of_a_fused_output_gets_its_own_adapter_weights():
    """qkv-like: three slices of widths 2, 1, 1; only the middle one's weights are non-zero."""
    x = torch.tensor([[1.0, 1.0]])
    a = [torch.zeros(1, 1, 2), torch.ones(1, 1, 2), torch.zeros(1, 1, 2)]
    b = [torch.zeros(1, 1, 2), torch.full((1, 1, 1), 3.0), torch.zeros(1, 1, 1)]
    y = add_lora(torch.zeros(1, 4), x, a, b, [torch.ones(1)] * 3, [0], [2, 1, 1])
    torch.testing.assert_close(y, torch.tensor([[0.0, 0.0, 6.0, 0.0]]),
                               msg="slice i adds into its own columns, after the widths before it")


def test_each_slot_has_its_own_scaling_and_padding_changes_nothing():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 6, generator=g)
    a[1, 1:], b[1, 1:] = 0, 0  # slot 1 holds a rank-1 adapter, zero-padded to rank 3
    scale = torch.tensor([0.25, 4.0])
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 6, generator=g)
    slots = [1, 0, 0, 1]
    out = add_lora(y.clone(), x, [a], [b], [scale], slots, [6])
    for t, s in enumerate(slots):
        want = y[t].double() + scale[s].double() * (x[t].double() @ a[s].double().T) @ b[s].double()
        torch.testing.assert_close(out[t].double(), want, rtol=1e-6, atol=1e-6,
                                   msg=f"token {t} (slot {s})")
