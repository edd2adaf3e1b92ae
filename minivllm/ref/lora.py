"""LoRA: add each token's own adapter delta to a projection's output, for a mixed batch.

A LoRA adapter (:mod:`minivllm.lora.models`) changes a projection ``y = x W^T`` by
a low-rank term, ``scaling * (x A^T) B^T`` with ``A (r, in)``, ``B (out, r)``. To
serve many fine-tunes of one base model in one batch, the engine keeps ``W``
once and runs the base matmul for every token together, as usual; then each
token adds the delta of *its own* adapter. This is that second part.

The adapters resident on the device sit in numbered slots, stacked
(:mod:`minivllm.lora.manager`), and the step's :class:`~minivllm.lora.mapping.LoRAMapping`
says which slot each token uses (``-1``: none). The model's projections are
*fused*: ``qkv_proj``'s output is ``[q | k | v]``, ``gate_up_proj``'s is
``[gate | up]``. Each part (an *output slice*) has its own A and B, since an
adapter trains ``q_proj``, ``k_proj`` and ``v_proj`` separately (or only some of
them: a slice it leaves alone has scaling 0 and zero weights). For token ``t``
with slot ``s`` and each slice ``i`` covering columns ``[o_i, o_i + n_i)`` of y::

    h       = x[t] @ A_i[s]^T               # shrink: (in,) -> (r,)   x along r directions
    delta   = h @ B_i[s]^T                  # expand: (r,) -> (n_i,)  a sum of r output vectors
    y[t, o_i : o_i + n_i] += scaling_i[s] * delta

The stacks hold ``B`` transposed (``lora_b[i][s]`` is ``B_i[s]^T``, ``(r, n_i)``),
so the expand reads ``h @ lora_b[i][s]``. Lower-rank adapters are zero-padded to
the stack's ``max_rank``, which changes nothing.

This page computes it as the definition says: one token at a time, in float32,
rounding once when adding into ``y``. Each token re-reads its adapter's weights,
and a batch makes ``T * slices`` small matrix-vector products. The fast twin
(:mod:`minivllm.fast.lora`) groups the tokens by slot (Punica's *segmented*
matmul: SGMV) so each adapter's A and B are read once per group, and does the
whole batch in one C++ op or two Triton launches per slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minivllm.lora.mapping import LoRAMapping, check_add_lora_args

__all__ = ["add_lora"]


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
             lora_b: Sequence[torch.Tensor], scalings: Sequence[torch.Tensor],
             mapping: LoRAMapping, output_slices: Sequence[int]) -> None:
    """Add every token's adapter delta to ``y`` in place (see the module docstring).

    Args:
        y: ``(T, sum(output_slices))``: the base projection's output, updated in place.
        x: ``(T, in)``: the projection's input.
        lora_a: per output slice, ``(max_loras, max_rank, in)``: A of every slot.
        lora_b: per output slice, ``(max_loras, max_rank, n_i)``: B^T of every slot.
        scalings: per output slice, ``(max_loras,)`` float32: each slot's scaling.
        mapping: the step's token -> slot map; ``mapping.token_slots[t] == -1``
            leaves token ``t`` as it is.
        output_slices: ``n_i``, the width of each slice of ``y``, in order.
    """
    check_add_lora_args(y, x, lora_a, lora_b, scalings, mapping, output_slices)
    # BEGIN SOLUTION
    token_slots = mapping.token_slots.tolist()
    offset = 0  # first column of the current slice in y
    for a, b, scale, width in zip(lora_a, lora_b, scalings, output_slices):
        for t, slot in enumerate(token_slots):
            if slot < 0:  # this token's request runs the base model alone
                continue
            h = x[t].float() @ a[slot].float().T  # shrink: (in,) -> (max_rank,)
            delta = h @ b[slot].float()  # expand: (max_rank,) -> (width,)
            y[t, offset : offset + width] += scale[slot] * delta  # one rounding, into y's dtype
        offset += width
    # END SOLUTION
