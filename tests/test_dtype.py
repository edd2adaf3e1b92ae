"""``dtype="auto"``: bfloat16 where a CPU multiplies bf16 natively, float32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from minivllm.dtype import auto_dtype, cpu_bf16_flags, resolve_dtype

ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512vl\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_flags_are_read_from_cpuinfo() -> None:
    assert cpu_bf16_flags(ZEN3) == []
    assert cpu_bf16_flags(ZEN4) == ["avx512_bf16"]
    assert cpu_bf16_flags(SPR) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags("flags : avx512_bf16x\n") == []  # whole words only


@pytest.mark.parametrize("info,expect", [(ZEN3, torch.float32), (ZEN4, torch.bfloat16),
                                         (SPR, torch.bfloat16)])  # fmt: skip
def test_auto_on_a_cpu_follows_the_bf16_instructions(info, expect) -> None:
    dtype, reason = auto_dtype(torch.device("cpu"), cpu_bf16_flags(info))
    assert dtype == expect
    assert ("native bf16" in reason) and (str(expect).split(".")[-1] in reason)


def test_auto_on_a_gpu_is_bf16_and_names_resolve() -> None:
    assert auto_dtype(torch.device("cuda"))[0] == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == auto_dtype(torch.device("cpu"))[0]
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("int7", torch.device("cpu"))


def test_a_build_for_another_cpu_chooses_as_that_cpu(monkeypatch):
    """Kernels built for an AVX2 laptop (MINIVLLM_CPU_ARCH=x86-64-v3) on a bf16 CPU: "auto"
    is float32, as on that laptop; a target with bf16 keeps this CPU's own choice."""
    from minivllm import cpu_target

    monkeypatch.delenv("MINIVLLM_CPU_ARCH", raising=False)
    native = cpu_bf16_flags()
    monkeypatch.setenv("MINIVLLM_CPU_ARCH", "x86-64-v3")
    if cpu_target.target_cpu_flags() is None:
        pytest.skip("not x86, or no compiler to say what x86-64-v3 has")
    assert cpu_bf16_flags() == []
    assert auto_dtype(torch.device("cpu"))[0] == torch.float32
    monkeypatch.setenv("MINIVLLM_CPU_ARCH", "sapphirerapids")  # avx512_bf16 and amx_bf16
    assert cpu_bf16_flags() == native
