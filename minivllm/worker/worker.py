"""``Worker``: one rank's model, its slice of the paged KV cache, its block table, its runner.

With one rank the engine runs a single worker in its own process; with
tensor or pipeline parallelism every rank runs one (see
:mod:`minivllm.executor.multiproc_executor`), holding only its own weight
shards, its own KV heads and its own pipeline stage's layers.

Each worker owns its block table (the engine's ``components.block_table``),
as vLLM v1's GPU model runner owns its ``BlockTable``: every step it applies
the changes the scheduler made (:class:`~minivllm.metadata.StepInput`: rows of
finished and preempted requests dropped, new rows, appended block ids), builds
the step's :class:`~minivllm.metadata.ModelInput` (block tables and slot
mapping included) on its own device, once, and hands it to its model runner
(the ``model_runner`` component: the model's own forward, or the fast twin's
CUDA graph / C++ layer stack of that same forward).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from minivllm import backend, distributed, kv_quant
from minivllm.engine.config import WorkerConfig
from minivllm.metadata import ModelInput, StepInput
from minivllm.pp_stages import IntermediateTensors, StageTiming
from minivllm.profiler import op_range
from minivllm.spec_decode.proposer import Speculator, make_proposer
from minivllm.step_sampling import ModelRunnerOutput
from minivllm.worker.sampling import StepSampler

logger = logging.getLogger("minivllm")
#: The most StageTiming records a worker keeps (the newest).
TIMELINE_STEPS = 10_000


class Worker:
    """Loads the model on one device and runs forward passes over the paged cache.

    Args:
        config: the model, dtype, device, parallel sizes and how to run it.
        components: the engine's :class:`~minivllm.backend.Components`: the
            model's layers, the block table and the model runner come from it
            (a spec, or None for the global one, is resolved once here).
        pp_rank: this worker is pipeline stage ``pp_rank``: it holds (weights
            and KV cache) only that stage's layers.
        device: this rank's device (default: the config's).
    """

    def __init__(self, config: WorkerConfig,
                 components: backend.Components | backend.BackendSpec | None = None,
                 pp_rank: int = 0, device: torch.device | None = None) -> None:
        from minivllm.model.loader import load_model

        self.config = config
        self.components = backend.as_components(components)
        self.device = torch.device(config.device if device is None else device)
        self.dtype = config.dtype
        # The KV cache's storage dtype: the model's, or int8 / e4m3 with scales beside it
        # (checked before the weights load: fp8 needs a recent GPU).
        self.cache_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, config.dtype, self.device)
        self.model, self.hf_config, self.tokenizer = load_model(
            config.model, dtype=config.dtype, device=self.device,
            tp_size=config.tensor_parallel_size, components=self.components,
            quantization=config.quantization, pp_rank=pp_rank,
            pp_size=config.pipeline_parallel_size,
            pp_layer_partition=config.pp_layer_partition, prepack=config.prepack,
        )
        inner = self.model.model
        self.pp_rank, self.pp_size = pp_rank, config.pipeline_parallel_size
        self.layer_range = (inner.start_layer, inner.end_layer)
        self.is_first_rank, self.is_last_rank = inner.is_first_rank, inner.is_last_rank
        attn = inner.layers[inner.start_layer].self_attn
        self.num_layers = inner.end_layer - inner.start_layer  # this stage's layers
        self.num_kv_heads = attn.num_kv_heads  # this rank's KV heads
        self.head_dim = attn.head_dim
        # Per layer (k_cache, v_cache), plus (k_scale, v_scale) for a quantized cache.
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.block_tables = None  # this rank's BlockTables, made by init_kv_cache
        self.model_runner = None  # made by init_kv_cache, over the KV cache
        #: the last stage's sampler (every tp rank of it: they sample alike), made by
        #: init_kv_cache
        self.sampler: StepSampler | None = None
        self.speculator: Speculator | None = None  # the sampling worker's, with drafts
        self.lora_manager = None
        if config.lora_config is not None:
            self._init_lora(config.lora_config)
        #: how this stage reaches its neighbours (a StageLink between processes, a
        #: SimulatedStageLink in one), or None: one stage, nothing to hand on
        self.link: Any = None
        self.num_batches = 0  # steps seen, with or without tokens: the micro-batch number
        # When this stage ran each of its last TIMELINE_STEPS micro-batches (bounded: a
        # server runs for days; the pipeline benchmark reads and clears it per run).
        self.timeline: collections.deque[StageTiming] = collections.deque(maxlen=TIMELINE_STEPS)

    # -- LoRA adapters ------------------------------------------------------------------

    def _init_lora(self, lora_config: Any) -> None:
        """The adapter slots for this rank's layers and shards, given to the model's
        projections (:func:`minivllm.lora.layers.enable_lora`): each step's forward then
        adds the adapters of the step's :class:`~minivllm.lora.mapping.LoRAMapping`."""
        from minivllm.lora.layers import enable_lora
        from minivllm.lora.manager import LoRAManager

        # Where one process computes every rank's output (ref.linear), it holds whole
        # adapters; a real rank holds its shards.
        real = distributed.is_initialized()
        tp_rank, tp_size = (distributed.get_tp_rank(), distributed.get_tp_size()) if real \
            else (0, 1)
        self.lora_manager = LoRAManager(self.hf_config, lora_config, self.dtype, self.device,
                                        tp_rank, tp_size, self.layer_range)
        self.lora_requests: dict[int, Any] = {}  # lora_int_id -> LoRARequest
        # The stacks are filled in place, so the model (and the C++ layer stack, which
        # binds them when the model runner is built) holds them once, for good.
        enable_lora(self.model, self.lora_manager.stacks)

    def add_lora(self, lora_request: Any) -> None:
        """Load (and check) an adapter into this rank's CPU cache; ``ValueError`` if bad."""
        if self.lora_manager is None:
            raise ValueError("a LoRA adapter needs enable_lora=True")
        self.lora_manager.add_lora(lora_request)
        self.lora_requests[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (its slot and its cached weights)."""
        if self.lora_manager is not None:
            self.lora_manager.remove_lora(lora_int_id)
            self.lora_requests.pop(lora_int_id, None)

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes one block costs on this rank, over all layers, K and V (and
        the scales of a quantized cache)."""
        row = kv_quant.bytes_per_token_head(self.head_dim, self.cache_dtype)
        return 2 * self.num_layers * block_size * self.num_kv_heads * row

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
                      max_num_blocks_per_req: int | None = None,
                      max_model_len: int | None = None) -> None:
        """Allocate one ``(num_blocks, block_size, H_kv, D)`` K and V tensor per layer
        (in ``kv_cache_dtype``; a quantized cache adds its ``(num_blocks, block_size,
        H_kv)`` float32 K and V scales), an empty block table for up to
        ``max_num_reqs`` requests of up to ``max_num_blocks_per_req`` blocks each
        (default: the whole pool), and the model runner over them; on the
        sampling worker, its sampler and (speculative decoding) its speculator,
        whose drafts stay below ``max_model_len`` (default: the blocks' tokens)."""
        self.kv_caches = [
            kv_quant.allocate(num_blocks, block_size, self.num_kv_heads, self.head_dim,
                              self.cache_dtype, self.device)
            for _ in range(self.num_layers)
        ]
        max_blocks = max_num_blocks_per_req or num_blocks
        self.block_tables = self.components.block_table.BlockTables(
            max_num_reqs, max_blocks, block_size, self.device)
        self._runner_shape = (max_num_reqs, max_blocks * block_size, block_size)
        self.build_model_runner(self.config.enforce_eager)
        if self.is_last_rank:  # every tp rank of the last stage samples, in lockstep
            self.sampler = StepSampler(
                self.components, self.hf_config.vocab_size, self.device, self.config.seed,
                self.config.num_speculative_tokens, self.config.logits_processors,
                max_num_reqs)
            spec = self.config.speculative_config
            if spec is not None:  # a draft model runs beside every layer (its shards)
                self.speculator = Speculator(
                    spec, make_proposer(spec, self.components,
                                        self if self.pp_size == 1 else None),
                    max_model_len or max_blocks * block_size)

    def build_model_runner(self, enforce_eager: bool) -> Any:
        """(Re)build the model runner and return it.

        ``enforce_eager=True`` runs the model's own forward on every step;
        otherwise the ``model_runner`` component decides (its fast twin
        replays CUDA graphs or runs the C++ layer stack, bit for bit the same).
        Tests and ``bench latency`` switch it to compare the two.
        """
        max_num_seqs, max_model_len, block_size = self._runner_shape
        self.model_runner = self.components.model_runner.ModelRunner(
            self.model, self.kv_caches, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            block_size=block_size, enforce_eager=enforce_eager)
        return self.model_runner

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
        """Apply the step's block changes, then build its model input on this rank's device.

        The changes: the block table's rows (:meth:`update_block_tables`), and
        the copy-on-write copies of blocks shared by forked requests, every
        layer's K and V, before the forward writes into the copies
        (``cache_write.copy_blocks``; only in steps that have any).
        """
        self.update_block_tables(step_input)
        if step_input.blocks_to_copy:
            mapping = torch.tensor(step_input.blocks_to_copy, dtype=torch.int64,
                                   device=self.device)  # (num_copies, 2): src, dst
            copy = self.components.cache_write.copy_blocks
            copy([kv[:2] for kv in self.kv_caches], mapping)
            if len(self.kv_caches[0]) > 2:  # a quantized cache: the scales go with the codes
                copy([(ks.unsqueeze(-1), vs.unsqueeze(-1))  # (num_blocks, bs, H_kv, 1)
                      for _, _, ks, vs in self.kv_caches], mapping)
        model_input = ModelInput.build(
            self.block_tables, step_input.req_ids, step_input.query_lens, step_input.seq_lens,
            step_input.input_ids, step_input.positions, step_input.logits_indices, self.device)
        if any(step_input.lora_ids):  # the step's adapters into their slots, tokens mapped
            requests = [self.lora_requests[i] if i else None for i in step_input.lora_ids]
            lora = self.lora_manager.prepare_step(requests, step_input.query_lens)
            model_input = dataclasses.replace(model_input, lora=lora.mapping)
        return model_input

    def execute_model(self, step_input: StepInput
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        """One engine step on this rank: its block table, its stage's layers, and on the
        sampling worker the step's tokens.

        On a pipeline stage after the first it receives the previous stage's
        :class:`~minivllm.pp_stages.IntermediateTensors` through :attr:`link`;
        a stage before the last sends its own on (and returns them); the last
        stage turns its logits into tokens as the step's
        :class:`~minivllm.step_sampling.SamplingPlan` says and returns a
        :class:`~minivllm.step_sampling.ModelRunnerOutput` (with real stages its
        tp rank 0 also sends it back to rank 0; a step without a plan returns
        its raw logits in it). None for a step without tokens (it only changes
        the block table).
        """
        plan = step_input.sampling
        if self.speculator is not None:  # a row dropped or rebuilt voids a draft's cache
            for rid in step_input.removed_req_ids:
                self.speculator.invalidate(rid)
        if plan is not None and self.sampler is not None:
            for rid in plan.finished_req_ids if self.speculator is not None else ():
                self.speculator.forget(rid)
            self.sampler.update_states(plan)  # even in a step without tokens
        model_input = self.prepare_model_input(step_input)
        batch, link = self.num_batches, self.link
        self.num_batches += 1
        if step_input.num_tokens == 0:
            return None
        received = None
        if link is not None and not link.is_first:
            received = link.recv_intermediate(step_input.num_tokens)
        start = time.time()
        out = self.run_model(model_input, received)
        rank, pp_rank, tp_rank = (0, 0, 0) if link is None else (link.rank, link.pp_rank,
                                                                 link.tp_rank)
        self.timeline.append(StageTiming(batch, rank, pp_rank, tp_rank, start, time.time()))
        if link is not None and not link.is_last:
            link.send_intermediate(out)  # (T, hidden) x 2, on to the next stage
            return out
        # Every tp rank of the last stage holds the same logits (gathered) and the same
        # generators, so they sample the same tokens: a draft model's forward, with its
        # collectives, then runs on all of them together. Rank 0 of the stage answers.
        with op_range("sample"):
            output = (ModelRunnerOutput(logits=out) if plan is None
                      else self.sampler.run(out, plan))
        if plan is not None and self.speculator is not None:
            with op_range("propose"):
                output = self._propose(output, plan)
        if link is not None and link.pp_size > 1:
            link.send_output(output)
        return output

    def _propose(self, output: ModelRunnerOutput, plan: Any) -> ModelRunnerOutput:
        """Speculative decoding, after sampling: the back-off hears each verification,
        and the requests that just sampled get their next drafts (their ``q`` rows
        stay with the sampler, for the step that verifies them)."""
        states = [self.sampler.requests[rid] for rid in output.req_ids]
        verified = dict(zip(plan.req_ids, plan.drafts))
        drafts, probs = self.speculator.step(
            states, output.sampled_token_ids, [verified.get(rid, ()) for rid in output.req_ids],
            [rid not in plan.no_drafts and self.block_tables.has_request(rid)  # a sibling
             for rid in output.req_ids], self.num_batches,  # forks first: no row yet
            plan.num_running)
        self.sampler.draft_probs.update(probs)
        return dataclasses.replace(output, draft_token_ids=drafts)

    def stage_timeline(self, clear: bool = False) -> list[StageTiming]:
        """This stage's :class:`~minivllm.pp_stages.StageTiming` records (``clear``: then forget them)."""
        records = list(self.timeline)
        if clear:
            self.timeline.clear()
        return records

    def shutdown(self) -> None:
        """Finish this rank's sends in flight (the last thing a rank does)."""
        if self.link is not None:
            self.link.wait_sends()

    @torch.inference_mode()
    def run_model(self, model_input: ModelInput,
                  intermediate_tensors: IntermediateTensors | None = None,
                  ) -> torch.Tensor | IntermediateTensors | None:
        """The forward pass alone, on a complete :class:`~minivllm.metadata.ModelInput`.

        On a pipeline stage before the last it takes the previous stage's
        ``intermediate_tensors`` (None on the first) and returns its own; the
        last stage returns the logits of the rows to sample.
        """
        if not self.is_last_rank:  # IntermediateTensors for the next stage
            return self.model_runner.execute_model(model_input, intermediate_tensors)
        return self.model_runner.execute_model_logits(model_input, intermediate_tensors)


def serve(worker: Worker) -> None:
    """A worker rank's loop (every rank but 0): receive a call, make it, until ``shutdown``.

    Every call is ``getattr(worker, method)(*args, **kwargs)``, received
    through the worker's :class:`~minivllm.executor.stage_link.StageLink`
    (:func:`~minivllm.executor.wire.pack_rpc`). A call that rank 0 waits on
    (``reply``) sends back ``(result, error)`` in one ``gather_object``, so a
    method that raises on a rank raises on rank 0 too and the loop goes on;
    a call without replies (a step) that raises ends this rank, which rank 0
    sees as a dead rank.
    """
    link = worker.link
    while True:
        method, args, kwargs, reply = link.recv_rpc()
        if not reply:
            getattr(worker, method)(*args, **kwargs)
        else:
            try:
                result = (getattr(worker, method)(*args, **kwargs), None)
            except Exception as e:  # handed to rank 0, which raises it
                result = (None, f"{type(e).__name__}: {e}")
            dist.gather_object(result, None, dst=0, group=distributed.get_world_cpu_group())
        if method == "shutdown":
            return
