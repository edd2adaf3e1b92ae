"""Weights in huge pages: a decode step streams them with fewer TLB misses (Linux).

A batch-1 decode step reads every weight once, front to back: SmolLM2 in
float32 is 538 MB, which in 4 KiB pages is 131,000 pages, each a TLB miss and
a page-table walk, far more than any TLB holds. In 2 MiB pages it is 270. Linux
backs anonymous memory with huge pages when the region is advised so
(``madvise(MADV_HUGEPAGE)``; ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` on many systems, and then nothing else gets them) *and* the pages
are first touched after the advice. So :func:`rehome` copies the weights
into one new, advised arena, in the order the model holds them (the order a
step reads them); every tensor that viewed the old memory (a tied embedding
and LM head) is pointed at the new one, so nothing is duplicated and no value
changes. One arena, because glibc serves an allocation below its mmap
threshold (which grows to 32 MiB as large blocks are freed) from memory it has
touched already, whose 4 KiB pages it keeps: with an allocation per weight of
2 MiB or more, a float32 SmolLM2 process had 378-482 MB in huge pages and an
int8 one 82 MB (none of its projections, all under 2 MiB); with one arena 516
and 184 MB. On the Zen 4 EPYC of docs/kernels.md that made a batch-1 step 6%
faster in int8 and 14% in gguf (in every alternated pair of processes); bfloat16
was the same, and float32's steps came in two modes per process either way.

The fast model runner calls it once per model on a CPU (the ref twin leaves the
weights where the loader put them). Where huge pages are off (``never``) or
on anything but Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from minivllm.quantized_weight import QuantizedWeight

#: The size of a huge page on x86-64 and most ARM64 kernels.
HUGE_PAGE = 2 << 20
#: Weights from this size move (a norm's few KB stay where they are).
MIN_BYTES = 4096
#: Where each weight starts in the arena: on a cache line.
ALIGN = 64
#: Linux's MADV_HUGEPAGE.
MADV_HUGEPAGE = 14
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """True on Linux with transparent huge pages not ``never``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _advised_storage(nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """Fresh memory for ``nbytes``, advised for huge pages: ``(storage, byte offset)``.

    The storage is one huge page longer than asked, so that the returned offset
    can start on a huge-page boundary; the memory is untouched (no page is
    backed yet), so its first writes get huge pages.
    """
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    addr = raw.data_ptr()
    offset = (-addr) % HUGE_PAGE
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.c_void_p(addr + offset), ctypes.c_size_t(length), MADV_HUGEPAGE)
    return raw.untyped_storage(), offset


def weight_tensors(model: torch.nn.Module, buffers: bool = True,
                   packed: bool = True) -> list[torch.Tensor]:
    """Every parameter, quantized weight's tensor and (with ``buffers``) buffer of ``model``;
    with ``packed``, also the prepacked copy of each quantized weight that has one
    (``packed_weight``: a batch-1 step reads it instead of the weight as stored)."""
    out = list(model.parameters()) + (list(model.buffers()) if buffers else [])
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QuantizedWeight):
                out += [t for t in (value.qweight, value.scales, value.mins)
                        if isinstance(t, torch.Tensor)]
        copy = getattr(module, "packed_weight", None)
        if (packed and isinstance(copy, torch.Tensor)
                and isinstance(getattr(module, "weight", None), QuantizedWeight)):
            out.append(copy)
    return out


@torch.no_grad()
def rehome(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move ``model``'s CPU weights of ``min_bytes`` or more into one huge-page-advised arena.

    The weights go in the order the model's modules hold them (for a decoder, the
    order a step reads them), each on a cache line. Values, shapes, strides and
    sharing are kept (each old storage is copied once, and every tensor on it is
    pointed at the copy). Returns the bytes moved (0 where huge pages are
    unavailable, or when called a second time).
    """
    if not huge_pages_available() or getattr(model, "_minivllm_hugepages", False):
        return 0
    groups: dict[int, list[torch.Tensor]] = {}  # by storage, in the order met
    for t in weight_tensors(model):
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.nbytes() >= min_bytes:
            group = groups.setdefault(storage.data_ptr(), [])
            if not any(t is u for u in group):
                group.append(t)
    if not groups:
        return 0
    starts, end, moved = [], 0, 0
    for tensors in groups.values():
        start = -(-end // ALIGN) * ALIGN
        starts.append(start)
        nbytes = tensors[0].untyped_storage().nbytes()
        end, moved = start + nbytes, moved + nbytes
    # One arena, not an allocation per weight: glibc serves allocations below its mmap
    # threshold (which grows to 32 MiB as large blocks are freed) from memory it has
    # already touched, which keeps its 4 KiB pages; an arena of the whole model is
    # mapped fresh. A weight of a few hundred KB (every int8 projection of SmolLM2)
    # gets huge pages too.
    new, base = _advised_storage(end)
    for tensors, start in zip(groups.values(), starts):
        old = tensors[0].untyped_storage()
        offset = base + start
        dst = torch.empty(0, dtype=torch.uint8).set_(new, offset, (old.nbytes(),), (1,))
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,)))
        for t in tensors:
            size = t.element_size()
            t.set_(new, (offset + t.storage_offset() * size) // size, t.size(), t.stride())
    model._minivllm_hugepages = True
    return moved
