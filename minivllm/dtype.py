"""Which dtype ``dtype="auto"`` means on this machine, and why.

- On a GPU: bfloat16.
- On a CPU with native bf16 dot products (x86 ``avx512_bf16`` or AMX): bfloat16.
  Decode reads every weight once per step, so half the bytes is nearly twice
  the speed, and oneDNN's bf16 GEMM there runs several times float32's rate.
- On any other CPU: float32. Without those instructions each bf16 value is
  widened to float32 in software before it is multiplied, and oneDNN's bf16
  GEMM is slower than its float32 one.

:func:`resolve_dtype` logs the choice and its reason once per process.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from types import MappingProxyType

import torch

from minivllm.cpu_target import target_cpu_flags

logger = logging.getLogger("minivllm")

DTYPES = MappingProxyType({
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
})  # fmt: skip

#: CPU flags (``/proc/cpuinfo``) that mean native bf16 dot products.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The :data:`BF16_CPU_FLAGS` this CPU has (read from ``/proc/cpuinfo`` on Linux),
    and, where the C++ kernels are built for another CPU (``MINIVLLM_CPU_ARCH``), that
    CPU has too: an AVX2 laptop's build measured on a newer CPU chooses as that laptop."""
    held = None
    if cpuinfo is None:
        held = target_cpu_flags()
        path = Path("/proc/cpuinfo")
        if platform.system() != "Linux" or not path.exists():
            return []
        cpuinfo = path.read_text(errors="replace")
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return [f for f in BF16_CPU_FLAGS if f in flags and (held is None or f in held)]


def auto_dtype(device: torch.device, bf16_flags: list[str] | None = None) -> tuple[torch.dtype, str]:
    """``(dtype, reason)`` for ``dtype="auto"`` on ``device``."""
    if device.type != "cpu":
        return torch.bfloat16, f"bfloat16 on {device.type}"
    flags = cpu_bf16_flags() if bf16_flags is None else bf16_flags
    if flags:
        return torch.bfloat16, (f"bfloat16: this CPU has native bf16 dot products "
                                f"({', '.join(flags)})")  # fmt: skip
    return torch.float32, ("float32: this CPU has no native bf16 dot products "
                           "(avx512_bf16 or AMX), so bf16 would be widened in software")


@functools.cache
def _log_once(reason: str) -> None:
    logger.info("dtype='auto' is %s", reason)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype name (or ``"auto"``, see the module docstring) as a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        chosen, reason = auto_dtype(device)
        _log_once(reason)
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]
