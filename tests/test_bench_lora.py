"""``python -m minivllm.bench lora`` runs, and its fast and ref columns agree (no timing asserted)."""

from __future__ import annotations

import pytest
import torch

from minivllm.bench import lora


def test_rows_and_agreement():
    from minivllm.fast import cpu_ops

    if not torch.cuda.is_available() and not cpu_ops.available():
        pytest.skip(f"the C++ CPU kernels are not available ({cpu_ops.unavailable_reason()})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = lora.run(rank=4, device=device, token_counts=(1, 5), adapter_counts=(1, 3))
    assert [(r["tokens"], r["adapters"]) for r in rows] == [(1, 1), (5, 1), (5, 3)]
    for r in rows:
        assert r["max_abs_err"] < 1e-4 and r["fast_ms"] > 0 and r["ref_ms"] > 0
    assert lora.delta_flops(2, 4) == 2 * 2 * 4 * (3 * 576 + 960 + 2 * 576 + 3072 + 1536 + 576
                                                  + 576 + 576)


def test_end_to_end_hook_says_it_is_not_wired_yet():
    with pytest.raises(SystemExit, match="issue 28"):
        lora.end_to_end(None)
