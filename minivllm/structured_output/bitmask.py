"""The token bitmask: one bit per token id, 32 to an int32 word (vLLM's and xgrammar's layout).

A batch's bitmask is an int32 tensor ``(B, ceil(V / 32))``: token ``t`` of row
``r`` is allowed when bit ``t % 32`` of word ``t // 32`` is set. 32 times
smaller than a bool mask, it is what vLLM fills on the host and copies to the
device each step. The bits past ``V`` in the last word mean nothing.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_width(vocab_size: int) -> int:
    """Words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:  # (..., V) bool -> (..., W) int32
    """Pack a bool mask into int32 words (bit ``t % 32`` of word ``t // 32``)."""
    v = allowed.shape[-1]
    bits = np.zeros((*allowed.shape[:-1], 32 * bitmask_width(v)), dtype=bool)
    bits[..., :v] = allowed.cpu().numpy()
    # Little-endian bit order packs token t into bit t % 8 of byte t // 8; four bytes read
    # as a little-endian int32 then hold token t in bit t % 32 of word t // 32.
    packed = np.packbits(bits, axis=-1, bitorder="little")
    return torch.from_numpy(packed.view("<i4").astype(np.int32))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # (..., W) -> (..., V)
    """The bool mask of the first ``vocab_size`` tokens of each row."""
    t = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask[..., t // 32]
    return ((words >> (t % 32)) & 1).bool()


def check_apply_args(logits: torch.Tensor, bitmask: torch.Tensor,
                     indices) -> torch.Tensor:  # -> (R,) int64 rows, on the logits' device
    """Validate ``apply_token_bitmask_inplace``'s arguments; the rows to mask.

    ``logits`` (B, V) float; ``bitmask`` (B, ceil(V / 32)) int32 on the same
    device; ``indices``: the rows to mask (a list or int tensor; ``None``: all).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a (batch, vocab) float tensor, got "
                         f"{getattr(logits, 'shape', logits)!r}")
    b, v = logits.shape
    if (not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32
            or tuple(bitmask.shape) != (b, bitmask_width(v))):
        raise ValueError(f"bitmask must be an int32 tensor of shape ({b}, {bitmask_width(v)}) "
                         f"for logits {tuple(logits.shape)}, got "
                         f"{getattr(bitmask, 'dtype', None)} {tuple(getattr(bitmask, 'shape', ()))}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask must be on the logits' device {logits.device}, "
                         f"got {bitmask.device}")
    if indices is None:
        return torch.arange(b, device=logits.device)
    rows = torch.as_tensor(indices, device=logits.device)
    if rows.dim() != 1 or (rows.numel() and (rows.is_floating_point() or rows.dtype == torch.bool)):
        raise ValueError(f"indices must be a 1-D list or tensor of row ids, got {indices!r}")
    rows = rows.to(torch.int64)
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < b):
        raise ValueError(f"indices must be row ids in [0, {b}), got {indices!r}")
    return rows
