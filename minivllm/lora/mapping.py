"""``LoRAMapping``: which adapter slot each token of a step uses, built once per step.

A step's batch is one flat stream of tokens from many requests (see
:mod:`minivllm.model.llama`), and each request may run with its own adapter. The
adapters resident on the device sit in numbered *slots* (:mod:`minivllm.lora.manager`),
so "which adapter" is, per token, a slot index, or ``-1`` for a request that runs
the base model alone::

    token_slots   = [ 2,  2,  2, -1,  0,  2,  0]     # (T,) one per token
    # grouped by slot, for the kernels (order inside a group kept):
    sorted_tokens = [ 4,  6,  0,  1,  2,  5]         # tokens of slot 0, then of slot 2
    seg_starts    = [ 0,  2,  6]                     # segment s: sorted_tokens[seg_starts[s]:seg_starts[s+1]]
    seg_slots     = [ 0,  2]                         # the slot of each segment

The grouping is what lets a kernel load an adapter's weights once for all the
tokens that use it (Punica's *segmented* matmul); vLLM's ``PunicaWrapper``
computes the same arrays once per step (``token_lora_indices``,
``sorted_token_ids``, ``lora_token_start_loc``, ``active_lora_ids``). Every layer and
projection of the step reuses them, so they are built here once, not in each
kernel call. The mapping carries the device tensors the kernels read and the
host-side copies (segment lengths, slots) that launch them without a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """One step's token -> adapter-slot map, grouped by slot (see the module docstring).

    Attributes:
        token_slots: ``(T,)`` int64 on the device: token ``t``'s slot, ``-1`` for none.
        sorted_tokens: ``(T_lora,)`` int64 on the device: the tokens that have a
            slot, grouped by slot (ascending), in token order inside a group.
        seg_starts: ``(S + 1,)`` int64 on the device: segment ``s`` is
            ``sorted_tokens[seg_starts[s] : seg_starts[s + 1]]``.
        seg_slots: ``(S,)`` int64 on the device: each segment's slot.
        slots: host copy of ``seg_slots``.
        seg_lens: host copy of the segment lengths.
        num_tokens: ``T``.
    """

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    slots: tuple[int, ...]
    seg_lens: tuple[int, ...]
    num_tokens: int

    @property
    def max_seg_len(self) -> int:
        """The longest segment (0 if no token has an adapter): the kernels' launch grid."""
        return max(self.seg_lens, default=0)

    @classmethod
    def build(cls, token_slots: Sequence[int] | torch.Tensor,
              device: torch.device | str = "cpu") -> LoRAMapping:
        """Group ``token_slots`` (one int per token, ``-1`` = no adapter) by slot, on the host."""
        slots = torch.as_tensor(token_slots, dtype=torch.int64).cpu().reshape(-1)  # (T,)
        if slots.numel() and int(slots.min()) < -1:
            raise ValueError(f"token_slots must be -1 (no adapter) or a slot index >= 0, "
                             f"got {int(slots.min())}")
        active = torch.nonzero(slots >= 0).flatten()  # (T_lora,) tokens with an adapter
        order = torch.argsort(slots[active], stable=True)  # group by slot, keep token order
        sorted_tokens = active[order]
        seg_slots, seg_lens = torch.unique_consecutive(slots[sorted_tokens], return_counts=True)
        seg_starts = torch.zeros(len(seg_lens) + 1, dtype=torch.int64)
        torch.cumsum(seg_lens, 0, out=seg_starts[1:])
        return cls(
            token_slots=slots.to(device), sorted_tokens=sorted_tokens.to(device),
            seg_starts=seg_starts.to(device), seg_slots=seg_slots.to(device),
            slots=tuple(seg_slots.tolist()), seg_lens=tuple(seg_lens.tolist()),
            num_tokens=int(slots.numel()))

    @classmethod
    def from_requests(cls, request_slots: Sequence[int], num_tokens: Sequence[int],
                      device: torch.device | str = "cpu") -> LoRAMapping:
        """The mapping of a flat batch: request ``i`` contributes ``num_tokens[i]`` tokens,
        all with slot ``request_slots[i]`` (``-1``: no adapter)."""
        if len(request_slots) != len(num_tokens):
            raise ValueError(f"request_slots and num_tokens must have one entry per request, "
                             f"got {len(request_slots)} and {len(num_tokens)}")
        per_token = [s for s, n in zip(request_slots, num_tokens) for _ in range(n)]
        return cls.build(per_token, device)


def check_add_lora_args(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                        lora_b: Sequence[torch.Tensor], scalings: Sequence[torch.Tensor],
                        mapping: LoRAMapping, output_slices: Sequence[int]) -> None:
    """``ValueError`` naming the argument unless the shapes of an ``add_lora`` call agree.

    The contract both twins of the ``lora`` component share: ``y (T, sum(output_slices))``,
    ``x (T, in)``; for each slice ``i``: ``lora_a[i] (max_loras, max_rank, in)``,
    ``lora_b[i] (max_loras, max_rank, output_slices[i])``, ``scalings[i] (max_loras,)``.
    """
    n = len(output_slices)
    if not (len(lora_a) == len(lora_b) == len(scalings) == n) or n == 0:
        raise ValueError(f"lora_a, lora_b, scalings and output_slices must have one entry per "
                         f"output slice, got {len(lora_a)}, {len(lora_b)}, {len(scalings)}, {n}")
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x and y must be 2-D (tokens, features), got x {tuple(x.shape)}, "
                         f"y {tuple(y.shape)}")
    if y.shape[0] != x.shape[0] or y.shape[1] != sum(output_slices):
        raise ValueError(f"y must be (T, sum(output_slices)) = ({x.shape[0]}, "
                         f"{sum(output_slices)}), got {tuple(y.shape)}")
    if mapping.num_tokens != x.shape[0]:
        raise ValueError(f"mapping has {mapping.num_tokens} tokens, x has {x.shape[0]}")
    for i, (a, b, s, size) in enumerate(zip(lora_a, lora_b, scalings, output_slices)):
        if a.dim() != 3 or a.shape[2] != x.shape[1]:
            raise ValueError(f"lora_a[{i}] must be (max_loras, max_rank, {x.shape[1]}), "
                             f"got {tuple(a.shape)}")
        if b.dim() != 3 or b.shape[:2] != a.shape[:2] or b.shape[2] != size:
            raise ValueError(f"lora_b[{i}] must be ({a.shape[0]}, {a.shape[1]}, {size}) "
                             f"(B transposed), got {tuple(b.shape)}")
        if s.shape != (a.shape[0],):
            raise ValueError(f"scalings[{i}] must be ({a.shape[0]},), got {tuple(s.shape)}")
        if mapping.slots and max(mapping.slots) >= a.shape[0]:
            raise ValueError(f"mapping uses slot {max(mapping.slots)}, but lora_a[{i}] has "
                             f"{a.shape[0]} slots")
