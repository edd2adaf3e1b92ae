"""The adapter manager: ``max_loras`` device slots, filled from an LRU cache of loaded adapters.

Serving many fine-tunes of one base model in one batch (Punica, S-LoRA, vLLM's
multi-LoRA) keeps the base weights once and puts a few adapters' small A and B
matrices beside them. Two levels of cache, as vLLM's ``LRUCacheWorkerLoRAManager``:

1. **The CPU cache**: up to ``max_cpu_loras`` adapters read from disk
   (:func:`~minivllm.lora.peft_format.load_adapter`), least recently used first out.
2. **The slots**: ``max_loras`` adapters resident in the *stacked* device tensors
   the kernels read. For each layer and fused projection (:class:`LoRAStack`)
   and each of its output slices (``q``, ``k``, ``v`` of ``qkv_proj``...)::

       lora_a[i]:   (max_loras, max_lora_rank, in)      slot s holds A_s, rows >= r_s zero
       lora_b[i]:   (max_loras, max_lora_rank, out_i)   slot s holds B_s^T, rows >= r_s zero
       scalings[i]: (max_loras,) float32                 alpha_s / r_s; 0: slot s leaves slice i alone

   B is stored *transposed* (rank-major): the expand step ``h B^T`` is then a
   weighted sum of ``r`` contiguous rows of length ``out``, which every kernel
   reads front to back. A lower-rank adapter is zero-padded: its extra rows of A
   give zeros that meet zero rows of B^T, so padding never changes the result.

Each step, :meth:`LoRAManager.prepare_step` takes the step's requests' adapters,
makes each one resident (loading it, or evicting the least recently used slot
that this step does not need), and returns a :class:`LoRABatch`: the stacks and
the step's :class:`~minivllm.lora.mapping.LoRAMapping` (each token's slot).
Filling a slot copies into the stacks in place, so the stack tensors a model
holds never change identity.

With tensor parallelism, a manager per rank holds that rank's shards
(:mod:`minivllm.lora.tp`): ``in``/``out`` above are then the rank's sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.lora.mapping import LoRAMapping
from minivllm.lora.models import (
    COLUMN_PARALLEL,
    PACKED_MODULES_MAPPING,
    LoRAModel,
    module_shapes,
)
from minivllm.lora.peft_format import load_adapter
from minivllm.lora.request import LoRARequest
from minivllm.lora.tp import shard_lora, shard_rows


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA settings (vLLM's ``LoRAConfig``; its ``LLM`` arguments).

    Attributes:
        max_loras: adapters resident on the device at once: the most distinct
            adapters one step can serve.
        max_lora_rank: the largest rank an adapter may have (slots are this wide).
        max_cpu_loras: adapters kept loaded in host memory (>= ``max_loras``);
            None: ``max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), "
                             f"got {cpu!r}")


@dataclass(frozen=True)
class LoRAStack:
    """One fused projection's adapter weights for every slot, in one layer.

    Attributes (one entry per output slice, e.g. q, k, v):
        modules: the checkpoint module of each slice (``("q_proj", "k_proj", "v_proj")``).
        lora_a: ``(max_loras, max_lora_rank, in)`` each.
        lora_b: ``(max_loras, max_lora_rank, out_i)`` each (B transposed).
        scalings: ``(max_loras,)`` float32 each; 0 where the slot does not adapt the slice.
        output_slices: ``out_i`` of each slice (they add up to the fused output).
    """

    modules: tuple[str, ...]
    lora_a: tuple[torch.Tensor, ...]
    lora_b: tuple[torch.Tensor, ...]
    scalings: tuple[torch.Tensor, ...]
    output_slices: tuple[int, ...]


@dataclass(frozen=True)
class LoRABatch:
    """What a model's forward needs for one step's adapters.

    Attributes:
        mapping: each token's slot (``mapping.token_slots``, -1: none), grouped by slot.
        layers: per decoder layer, fused projection name (``qkv_proj``, ``o_proj``,
            ``gate_up_proj``, ``down_proj``) -> its :class:`LoRAStack`; None for a
            layer another pipeline stage holds.
    """

    mapping: LoRAMapping
    layers: tuple[Mapping[str, LoRAStack] | None, ...]

    def stack(self, layer: int, projection: str) -> LoRAStack:
        """The stacks of ``projection`` in decoder layer ``layer``."""
        return self.layers[layer][projection]


class LoRAManager:
    """Loads adapters, keeps them in slots, and maps a step's tokens to slots.

    Args:
        hf_config: the base model's HF config (sizes, layer count, heads).
        lora_config: :class:`LoRAConfig`.
        dtype: the dtype of the stacks (the model's activations').
        device: where the stacks and the mapping live.
        tp_rank, tp_size: this process's tensor-parallel rank; it holds that rank's
            shards. Use ``tp_size=1`` where one process computes the dense output
            (:mod:`minivllm.ref.linear`).
        layer_range: the decoder layers this process runs (pipeline parallelism);
            None: all.
    """

    def __init__(self, hf_config: Any, lora_config: LoRAConfig,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp_rank: int = 0, tp_size: int = 1,
                 layer_range: tuple[int, int] | None = None) -> None:
        self.hf_config, self.lora_config = hf_config, lora_config
        self.dtype, self.device = dtype, torch.device(device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        num_layers = hf_config.num_hidden_layers
        self.layer_range = layer_range or (0, num_layers)
        self._cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # LRU first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # resident id -> slot, LRU first
        self._free_slots = list(range(lora_config.max_loras))
        self.stacks: tuple[Mapping[str, LoRAStack] | None, ...] = tuple(
            self._make_layer() if self.layer_range[0] <= i < self.layer_range[1] else None
            for i in range(num_layers))

    # -- the stacked tensors --------------------------------------------------------------

    def _local_size(self, module: str, full: int, column: bool) -> int:
        """The size of this rank's shard of a module's output (column) or input (row) dim."""
        if (module in COLUMN_PARALLEL) != column:
            return full
        return shard_rows(module, self.hf_config, self.tp_rank, self.tp_size)[1]

    def _make_layer(self) -> Mapping[str, LoRAStack]:
        shapes = module_shapes(self.hf_config)
        slots, rank = self.lora_config.max_loras, self.lora_config.max_lora_rank
        layer = {}
        for projection, modules in PACKED_MODULES_MAPPING.items():
            ins = [self._local_size(m, shapes[m][0], column=False) for m in modules]
            outs = [self._local_size(m, shapes[m][1], column=True) for m in modules]
            kw = dict(dtype=self.dtype, device=self.device)
            layer[projection] = LoRAStack(
                modules=modules,
                lora_a=tuple(torch.zeros(slots, rank, n, **kw) for n in ins),
                lora_b=tuple(torch.zeros(slots, rank, n, **kw) for n in outs),
                scalings=tuple(torch.zeros(slots, dtype=torch.float32, device=self.device)
                               for _ in modules),
                output_slices=tuple(outs))
        return layer

    def _fill_slot(self, slot: int, adapter: LoRAModel) -> None:
        """Copy ``adapter`` (this rank's shards) into ``slot`` of every stack; zero the rest."""
        for layer_index, layer in enumerate(self.stacks):
            if layer is None:
                continue
            for stack in layer.values():
                for i, module in enumerate(stack.modules):
                    a, b, scale = stack.lora_a[i][slot], stack.lora_b[i][slot], stack.scalings[i]
                    a.zero_()
                    b.zero_()
                    weights = adapter.get(layer_index, module)
                    if weights is None:  # the adapter leaves this slice alone
                        scale[slot] = 0.0
                        continue
                    wa, wb = shard_lora(module, weights.lora_a, weights.lora_b, self.hf_config,
                                        self.tp_rank, self.tp_size)
                    a[: weights.rank].copy_(wa)  # (r, in)
                    b[: weights.rank].copy_(wb.T)  # (r, out): B transposed
                    scale[slot] = weights.scaling

    def _clear_slot(self, slot: int) -> None:
        for layer in self.stacks:
            for stack in (layer or {}).values():
                for scale in stack.scalings:
                    scale[slot] = 0.0

    # -- the CPU cache -----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> LoRAModel:
        """Load ``lora_request``'s adapter into the CPU cache (if not there) and return it.

        Call it when a request arrives: every check of the adapter
        (:func:`~minivllm.lora.peft_format.load_adapter`) raises its ``ValueError``
        here, before the request is queued. A full cache evicts its least recently
        used adapter (from its slot too, if it has one). An id already loaded under
        another name or path is a ``ValueError``.
        """
        cached = self._cpu_cache.get(lora_request.lora_int_id)
        if cached is not None:
            if (cached.lora_name, cached.lora_path) != (lora_request.lora_name,
                                                        lora_request.lora_path):
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already loaded as "
                    f"{cached.lora_name!r} from {cached.lora_path!r}, not "
                    f"{lora_request.lora_name!r} from {lora_request.lora_path!r}")
            self._cpu_cache.move_to_end(lora_request.lora_int_id)
            return cached
        adapter = load_adapter(lora_request, self.hf_config, self.lora_config.max_lora_rank,
                               self.dtype)
        while len(self._cpu_cache) >= self.lora_config.max_cpu_loras:
            self.remove_lora(next(iter(self._cpu_cache)))
        self._cpu_cache[lora_request.lora_int_id] = adapter
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the CPU cache and its slot; False if it was not loaded."""
        if self._cpu_cache.pop(lora_int_id, None) is None:
            return False
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._clear_slot(slot)
            self._free_slots.append(slot)
        return True

    def list_loras(self) -> list[int]:
        """The ids in the CPU cache, least recently used first."""
        return list(self._cpu_cache)

    def resident(self) -> dict[int, int]:
        """``lora_int_id -> slot`` of the adapters on the device, least recently used first."""
        return dict(self._slot_of)

    # -- one step --------------------------------------------------------------------------

    def prepare_step(self, lora_requests: Sequence[LoRARequest | None],
                     num_tokens: Sequence[int]) -> LoRABatch:
        """Make the step's adapters resident; return its :class:`LoRABatch`.

        Args:
            lora_requests: per scheduled request, in batch order, its adapter or None.
            num_tokens: per scheduled request, the tokens it computes this step.

        Raises ``ValueError`` if the step needs more distinct adapters than
        ``max_loras`` (the scheduler must never schedule that), or if loading an
        adapter fails. A slot this step needs is never evicted.
        """
        needed = list(dict.fromkeys(r.lora_int_id for r in lora_requests if r is not None))
        if len(needed) > self.lora_config.max_loras:
            raise ValueError(
                f"this step needs {len(needed)} distinct adapters {needed}, above "
                f"max_loras={self.lora_config.max_loras}: the scheduler must skip a waiting "
                "request whose adapter has no slot (SchedulerConfig.max_loras, "
                "Scheduler._has_lora_slot)")
        # Touch the cached ones first, so that loading the others evicts none of them.
        for lora_id in needed:
            if lora_id in self._cpu_cache:
                self._cpu_cache.move_to_end(lora_id)
        first = {}
        for r in lora_requests:
            if r is not None:
                first.setdefault(r.lora_int_id, r)
        for lora_id in needed:
            adapter = self.add_lora(first[lora_id])
            if lora_id not in self._slot_of:
                slot = self._take_slot(needed)
                self._fill_slot(slot, adapter)
                self._slot_of[lora_id] = slot
            self._slot_of.move_to_end(lora_id)
        slots = [-1 if r is None else self._slot_of[r.lora_int_id] for r in lora_requests]
        mapping = LoRAMapping.from_requests(slots, num_tokens, self.device)
        return LoRABatch(mapping=mapping, layers=self.stacks)

    def _take_slot(self, needed: list[int]) -> int:
        """A free slot, else the least recently used slot whose adapter ``needed`` lacks."""
        if self._free_slots:
            return self._free_slots.pop(0)
        for lora_id, slot in self._slot_of.items():  # LRU first
            if lora_id not in needed:
                del self._slot_of[lora_id]
                return slot
        raise AssertionError("unreachable: needed <= max_loras was checked")
