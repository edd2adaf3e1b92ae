"""Pipeline parallelism's split rule and stage forward (twin of the ref, the same code).

Nothing here is worth doing differently: the split is a few integer
operations once per engine, and a stage's forward is the model's own layers,
whose kernels come from their own components. The speed of real pipeline
parallelism is in overlapping stages (the engine's batch queue,
:mod:`minivllm.engine.pipeline`), not in this code. Read
:mod:`minivllm.ref.pipeline`.
"""

from __future__ import annotations

from minivllm.ref.pipeline import get_pp_indices, stage_forward

__all__ = ["get_pp_indices", "stage_forward"]
