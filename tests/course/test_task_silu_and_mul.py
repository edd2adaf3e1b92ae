"""Course task: SiLU-and-mul, against ``silu(gate) * up`` written out in float64."""

from __future__ import annotations

import torch

from minivllm import backend


def test_gate_is_the_first_half():
    gate = torch.tensor([[-2.0, 0.0, 1.0, 3.0]])
    up = torch.tensor([[1.0, 5.0, -2.0, 0.5]])
    out = backend.get("activation").silu_and_mul(torch.cat([gate, up], dim=-1))
    want = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6,
                               msg="silu_and_mul(x) must be silu(first half) * second half")
