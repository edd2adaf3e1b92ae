"""``Worker``: one rank's model, its slice of the paged KV cache, and its block table.

With ``tensor_parallel_size=1`` the engine runs a single worker in its own
process. With tensor parallelism each rank runs one (see
:mod:`minivllm.engine.multiproc_executor`); each rank holds only its own
weight shards and its own KV heads.

Each worker owns its block table (the engine's ``components.block_table``), as vLLM
v1's GPU model runner owns its ``BlockTable``: every step it applies the
changes the scheduler made (:class:`~minivllm.metadata.StepInput`: rows of
finished and preempted requests dropped, new rows, appended block ids) and
then builds the step's :class:`~minivllm.metadata.ModelInput`, block tables
and slot mapping included, on its own device, once. So rank 0 never packs
whole block tables, and the attention kernels find every per-step length as
a host copy in the frozen :class:`~minivllm.metadata.AttentionMetadata`.
"""

from __future__ import annotations

import logging

import torch

from minivllm import backend
from minivllm.metadata import AttentionMetadata, ModelInput, StepInput
from minivllm.pp_stages import IntermediateTensors

logger = logging.getLogger("minivllm")


class Worker:
    """Loads the model on one device and runs forward passes over the paged cache.

    Args:
        model: a registered name, an HF model directory or a ``.gguf`` file.
        dtype: weight and activation dtype.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        tp_size: tensor-parallel world size the layers are built for.
        components: the engine's :class:`~minivllm.backend.Components`: the
            model's layers and the block table come from it (a spec, or None
            for the global one, is resolved once here).
        quantization: None, ``"int8"``, ``"int4"`` or ``"gguf"`` (see
            :mod:`minivllm.model.quantization`).
        pp_rank, pp_size: this worker is pipeline stage ``pp_rank`` of
            ``pp_size``: it holds (weights and KV cache) only that stage's layers.
        pp_layer_partition: layers per stage (``"4,3,3"``), or None for the rule.
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int = 1,
                 components: backend.Components | backend.BackendSpec | None = None,
                 quantization: str | None = None, pp_rank: int = 0, pp_size: int = 1,
                 pp_layer_partition: str | tuple[int, ...] | None = None) -> None:
        from minivllm.model.loader import load_model

        self.components = backend.as_components(components)
        self.device = torch.device(device)
        self.dtype = dtype
        self.model, self.hf_config, self.tokenizer = load_model(
            model, dtype=dtype, device=self.device, tp_size=tp_size,
            components=self.components, quantization=quantization,
            pp_rank=pp_rank, pp_size=pp_size, pp_layer_partition=pp_layer_partition,
        )
        inner = self.model.model
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.layer_range = (inner.start_layer, inner.end_layer)
        self.is_first_rank, self.is_last_rank = inner.is_first_rank, inner.is_last_rank
        attn = inner.layers[inner.start_layer].self_attn
        self.num_layers = inner.end_layer - inner.start_layer  # this stage's layers
        self.num_kv_heads = attn.num_kv_heads  # this rank's KV heads
        self.head_dim = attn.head_dim
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_tables = None  # this rank's BlockTables, made by init_kv_cache
        self.graph_runner = None  # a CUDAGraphRunner once decode graphs are captured
        self.cpu_fast_path = None  # a CPUFastPath once the KV cache exists (CPU, C++ ops)

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes one block costs on this rank, over all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this worker holds: ``{"weights": ..., "kv_cache": ...}`` (its own layers only)."""
        def nbytes(tensors) -> int:
            seen, total = set(), 0
            for t in tensors:
                if t.data_ptr() not in seen:  # a tied LM head is the embedding matrix
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
            return total

        state = list(self.model.parameters()) + list(self.model.buffers())
        return {"weights": nbytes(state),
                "kv_cache": nbytes(t for kv in self.kv_caches for t in kv)}

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int = 256,
                      max_num_blocks_per_req: int | None = None) -> None:
        """Allocate one ``(num_blocks, block_size, H_kv, D)`` K and V tensor per layer,
        and an empty block table for up to ``max_num_reqs`` requests of up to
        ``max_num_blocks_per_req`` blocks each (default: the whole pool)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        self.block_tables = self.components.block_table.BlockTables(
            max_num_reqs, max_num_blocks_per_req or num_blocks, block_size, self.device
        )
        self.set_cpu_fast_path(True)

    def set_cpu_fast_path(self, enabled: bool) -> bool:
        """Run the forward through :class:`~minivllm.engine.cpu_fast_path.CPUFastPath`
        (the default where it can run) or plainly; return whether it is now on.

        Both give bit-identical results; benchmarks and tests switch it off to
        compare. It needs the KV cache (:meth:`init_kv_cache`).
        """
        from minivllm.engine.cpu_fast_path import CPUFastPath

        self.cpu_fast_path = CPUFastPath.build(self.model, self.kv_caches) if enabled else None
        return self.cpu_fast_path is not None

    def update_block_tables(self, step_input: StepInput) -> None:
        """Apply the scheduler's block-table changes for this step to this rank's table.

        Rows of removed requests go first (a finished id may be reused by a
        new request in the same step). A new request that still has a row, or
        blocks for a request without one, raise ``ValueError``: the table is
        out of step with the scheduler, and reading it would be silently wrong.
        """
        tables = self.block_tables
        for req_id in step_input.removed_req_ids:
            if tables.has_request(req_id):  # one aborted while waiting never had a row
                tables.remove_request(req_id)
        for req_id, block_ids in zip(step_input.req_ids, step_input.new_block_ids):
            if req_id in step_input.new_req_ids:
                tables.add_request(req_id)
            if block_ids:
                tables.append_blocks(req_id, list(block_ids))

    def prepare_model_input(self, step_input: StepInput) -> ModelInput:
        """Update the block table, then build this step's model input on this rank's device."""
        self.update_block_tables(step_input)
        req_ids = list(step_input.req_ids)
        starts = [s - q for s, q in zip(step_input.seq_lens, step_input.query_lens)]
        dev = self.device
        attn_metadata = AttentionMetadata.build(
            query_lens=step_input.query_lens,
            seq_lens=step_input.seq_lens,
            block_tables=self.block_tables.block_table_tensor(req_ids),
            slot_mapping=self.block_tables.slot_mapping(req_ids, starts,
                                                        list(step_input.query_lens)),
            device=dev,
        )
        return ModelInput(
            input_ids=step_input.input_ids.to(dev),
            positions=step_input.positions.to(dev),
            attn_metadata=attn_metadata,
            logits_indices=step_input.logits_indices.to(dev),
        )

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int) -> bool:
        """Capture decode steps as CUDA graphs (see ``cuda_graph.py``); True on success.

        Needs a CUDA device and the fast attention and cache-write kernels (the
        ref twins synchronise with the host, which a graph cannot record). Any
        failure leaves the worker running eagerly, with a warning.
        """
        from minivllm.engine.cuda_graph import CUDAGraphRunner

        if self.device.type != "cuda":
            return False
        if any(self.components.impls[c] != "fast" for c in ("attention", "cache_write")):
            logger.warning("minivllm: CUDA graphs need the fast attention and cache_write; "
                           "running eagerly")
            return False
        try:
            runner = CUDAGraphRunner(self.model, self.kv_caches, max_num_seqs, max_model_len,
                                     block_size)
            runner.capture()
        except Exception as e:  # noqa: BLE001 -- any capture failure means: run eagerly
            logger.warning("minivllm: CUDA graph capture failed (%s); running eagerly", e)
            return False
        self.graph_runner = runner
        return True

    def execute_model(self, step_input: StepInput) -> torch.Tensor | None:
        """One engine step on this rank: ``(num_sampled, vocab)`` float32 logits.

        None when the step only changes the block table (no tokens), and on
        tensor-parallel ranks other than 0 (the logits are gathered to rank 0).
        """
        model_input = self.prepare_model_input(step_input)
        if step_input.num_tokens == 0:
            return None
        return self.run_model(model_input)

    @torch.inference_mode()
    def run_model(self, model_input: ModelInput,
                  intermediate_tensors: IntermediateTensors | None = None,
                  ) -> torch.Tensor | IntermediateTensors | None:
        """The forward pass alone, on a complete :class:`~minivllm.metadata.ModelInput`.

        On a pipeline stage before the last it takes the previous stage's
        ``intermediate_tensors`` (None on the first) and returns its own; the
        last stage returns the logits.
        """
        if not (self.is_first_rank and self.is_last_rank):
            out = self.model(model_input.input_ids, model_input.positions, self.kv_caches,
                             model_input.attn_metadata, intermediate_tensors)
            if not self.is_last_rank:
                return out  # IntermediateTensors for the next stage
            return self.model.compute_logits(out[model_input.logits_indices])
        if self.graph_runner is not None and self.graph_runner.can_run(model_input):
            hidden = self.graph_runner.run(model_input)
        elif self.cpu_fast_path is not None and not torch._C._autograd._profiler_enabled():
            # While a profiler records, the plain path runs so that its op table names
            # every kernel; the fast path calls the same kernels, without the ranges.
            hidden = self.cpu_fast_path.run(model_input)
        else:
            hidden = self.model(
                model_input.input_ids, model_input.positions, self.kv_caches,
                model_input.attn_metadata,
            )  # (num_tokens, hidden)
        return self.model.compute_logits(hidden[model_input.logits_indices])
