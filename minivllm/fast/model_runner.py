"""The model runner that takes the host overhead out of a step (twin of the ref).

Read :mod:`minivllm.ref.model_runner` first: a runner runs a step's forward
pass. The ref calls the model's own forward. This twin runs *the same
forward* a faster way where it can, and calls the ref's (the model's own
forward) everywhere else:

- **CUDA**: decode-only steps replay a CUDA graph captured from the model's
  own forward (:mod:`minivllm.fast.model_runner_cuda`): one launch instead of
  a few hundred. Prefills run the model's forward.
- **CPU**: steps of up to a few dozen rows run the whole layer stack in one
  C++ call (:class:`LayerStack`, below; what it runs:
  :mod:`minivllm.fast.model_runner_rules`) that calls the very ops the model's
  kernel components call, in the same order, so the result is bit for bit the
  model's forward; with :meth:`ModelRunner.execute_model_logits` the same call
  embeds the tokens and ends with the final norm and the LM head. A long
  prefill chunk runs the model's forward.

**A whitelist, not a blacklist.** The model declares, by name, every feature
its forward uses (``LlamaForCausalLM.features``: ``"gqa"``, ``"qkv_bias"``,
``"qk_norm"``, ``"tensor_parallel"``, ...). Each fast path runs a model only
if it implements *every* declared feature; anything else runs the model's
forward, and the reason is logged once. A feature added to the model later is
therefore never silently computed wrongly: it runs plainly until a fast path
learns it.

**The CPU path, in detail.** At batch 1 a SmolLM2 decode step runs 30 layers of
about ten kernels each, and every kernel is small (a 576-wide RMSNorm is a
microsecond of work). The model's forward pays, per kernel, for things that do
not change within a step: ``nn.Module.__call__``, a profiler check, the kernel
wrapper's input checks and casts (repeated in all 30 layers although the
inputs are the same), an output allocation: milliseconds a step, more than
the kernels of a small model. :class:`LayerStack` writes the same loop in C++
(``minivllm/fast/csrc/layer_stack.cpp``, ``torch.ops.minivllm.decode_layers``),
calling the very C++ ops the model's kernel components call, into buffers
allocated once per call. :meth:`LayerStack.build` checks once that it may
(:mod:`minivllm.fast.model_runner_rules`): the model declares only features the
loop implements (:data:`SUPPORTED_FEATURES`), every kernel component is the C++
op (not the ref, not a student's package), and every projection is a weight the
loop multiplies (float32 or bf16, or int8 / int4
:class:`~minivllm.quantized_weight.QuantizedWeight` of the fast quantization twin,
GGUF blocks included, with float or int8 activations: W8A16 / W4A16 / W8A8 / W4A8)
without a bias, as :func:`~minivllm.fast.linear_kernel.projection_kernel` decides
for the linear forward too; :meth:`LayerStack.can_run` checks per step that every
projection is a GEMV at that many rows (a long prefill chunk runs the model's
forward, whose GEMMs dominate it). The KV cache may be of any ``kv_cache_dtype``:
an int8 / fp8 layer's scales go to the same cache-write and attention ops, as the
model's forward passes them. LoRA adapters (``"lora"``: :mod:`minivllm.lora.layers`)
stay in the loop too: every projection's adapter stacks are bound once, a step
passes its token -> slot map, and after each projection the loop calls the
``add_lora`` op the model's ``ProjectionLoRA`` calls. Around the layers the same
call looks up the step's embeddings (a plain one-rank table) and ends with the
final norm and, for :meth:`ModelRunner.execute_model_logits`, the LM head on the
rows to sample: float32 logits, bit for bit the model's ``compute_logits``. Each
of those was a Python call of its own, and after a step has streamed its weights
every Python call runs from cold caches (docs/kernels.md, "The host between two
C++ calls").

**The model's forward wins** where a reader or a tool needs it:
``enforce_eager=True`` (a breakpoint in ``LlamaDecoderLayer.forward`` fires
on every step, on every device), and while a torch profiler records
(:func:`minivllm.profiler.is_recording`), so that the op table names every
kernel.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from minivllm.fast import model_runner_hugepages as hugepages
from minivllm.fast.linear_kernel import ProjectionKernel, kind_numbers
from minivllm.fast.model_runner_rules import (
    SUPPORTED_FEATURES,
    components_why_not,
    embedding_table,
    lm_head_kernel,
    projection_kernel_of,
)
from minivllm.lora.layers import projection_loras
from minivllm.metadata import ModelInput
from minivllm.profiler import is_recording
from minivllm.ref import model_runner as _ref

__all__ = ["ModelRunner"]

logger = logging.getLogger("minivllm")

#: The model features a CUDA graph of the model's forward can replay (one device:
#: no collectives inside the graph, and a whole model, not a pipeline stage).
#: ``"lora"``: the graphs hold the base model only, so a step with adapters runs the
#: model's forward (:meth:`ModelRunner.execute_model`); steps without replay.
CUDA_GRAPH_FEATURES = frozenset({
    "embedding", "rms_norm", "qkv_proj", "qkv_bias", "qk_norm", "gqa", "rope",
    "paged_attention", "o_proj", "o_bias", "silu_gated_mlp", "mlp_bias", "final_norm",
    "tied_embeddings", "lora",
})


class ModelRunner(_ref.ModelRunner):
    """Runs a model's forward pass, the same bits faster (see the module docstring).

    Args:
        model: a :class:`~minivllm.model.llama.LlamaForCausalLM` (or a
            pipeline stage of one, or a ``first_layers`` view of one).
        kv_caches: one ``(k_cache, v_cache)`` pair per layer the model holds
            (``(k_cache, v_cache, k_scale, v_scale)`` for an int8 / fp8 cache).
        max_num_seqs: the largest decode batch a CUDA graph is captured for.
        max_model_len: the longest sequence (sizes the graphs' block tables);
            None: the model's ``max_position_embeddings``.
        block_size: tokens per KV block.
        enforce_eager: always run the model's own forward.

    Attributes:
        layer_stack: the C++ layer stack, or None.
        cuda_graphs: the captured CUDA graphs, or None.
        fallback_reason: why neither runs (None if one does).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 block_size: int = 16, enforce_eager: bool = False) -> None:
        super().__init__(model, kv_caches, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, block_size=block_size,
                         enforce_eager=enforce_eager)
        self.layer_stack = None
        self.cuda_graphs = None
        if enforce_eager:
            self.fallback_reason = "enforce_eager=True"
        elif kv_caches and kv_caches[0][0].device.type == "cuda":
            if max_model_len is None:
                max_model_len = model.config.max_position_embeddings
            self.fallback_reason = self._capture(max_num_seqs, max_model_len, block_size)
        else:
            built = LayerStack.build(model, kv_caches)
            self.layer_stack = None if isinstance(built, str) else built
            self.fallback_reason = built if isinstance(built, str) else None
        if self.fallback_reason is not None:
            logger.info("minivllm: the model runner runs the model's own forward: %s",
                        self.fallback_reason)

    def _capture(self, max_num_seqs: int, max_model_len: int, block_size: int) -> str | None:
        """Capture the decode graphs; the reason if they cannot be."""
        from minivllm.fast import attention, cache_write
        from minivllm.fast.model_runner_cuda import CUDAGraphRunner

        model = self.model
        unsupported = sorted(model.features - CUDA_GRAPH_FEATURES)
        if unsupported:
            return f"a CUDA graph does not replay {', '.join(unsupported)}"
        graph_safe = ({attention.paged_attention, attention.paged_attention_triton},
                      {cache_write.reshape_and_cache, cache_write.reshape_and_cache_triton})
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.ops_attn.paged_attention not in graph_safe[0] or \
                    attn.ops_cache.reshape_and_cache not in graph_safe[1]:
                return ("CUDA graphs need the fast attention and cache_write (the ref twins "
                        "synchronise with the host)")
        try:
            runner = CUDAGraphRunner(model, self.kv_caches, max_num_seqs, max_model_len,
                                     block_size)
            runner.capture()
        except Exception as e:  # noqa: BLE001 -- any capture failure means: run eagerly
            logger.warning("minivllm: CUDA graph capture failed (%s); running eagerly", e)
            return f"CUDA graph capture failed ({e})"
        self.cuda_graphs = runner
        return None

    @property
    def fast_paths(self) -> tuple[str, ...]:
        """``("cpu_layer_stack",)``, ``("cuda_graphs",)``, or ``()`` where neither runs."""
        return tuple(name for name, path in (("cpu_layer_stack", self.layer_stack),
                                             ("cuda_graphs", self.cuda_graphs))
                     if path is not None)

    def describe(self) -> str:
        """How the forward runs, in words (the engine logs it at start-up)."""
        if self.layer_stack is not None:
            return (f"the C++ layer stack for steps of up to {self.layer_stack.max_rows} "
                    "tokens, else the model's own forward")
        if self.cuda_graphs is not None:
            return (f"CUDA graphs for decode batches of up to {self.cuda_graphs.max_bs}, "
                    "else the model's own forward")
        return f"the model's own forward ({self.fallback_reason})"

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput, intermediate_tensors: Any = None) -> Any:
        """The model's forward over one step, by the fastest path that runs it exactly."""
        if not is_recording():
            if self.layer_stack is not None and self.layer_stack.can_run(model_input):
                return self.layer_stack.run(model_input)  # LoRA deltas included
            # The graphs replay the base model: a step with LoRA adapters runs eagerly.
            if self.cuda_graphs is not None and model_input.lora is None \
                    and self.cuda_graphs.can_run(model_input):
                return self.cuda_graphs.run(model_input)
        return super().execute_model(model_input, intermediate_tensors)

    @torch.inference_mode()
    def execute_model_logits(self, model_input: ModelInput,
                             intermediate_tensors: Any = None) -> torch.Tensor:
        """The ref's forward-then-logits; on a CPU the layer stack computes the logits in
        the same C++ call where it has the LM head bound (the same bits)."""
        stack = self.layer_stack
        if (stack is not None and stack.lm_head is not None and intermediate_tensors is None
                and not is_recording() and stack.can_run(model_input)):
            return stack.run(model_input, logits=True)
        return super().execute_model_logits(model_input, intermediate_tensors)


# ----------------------------------------------------------------------------- the CPU path

#: logits_indices of a call without the LM head (decode_layers reads none).
_NO_ROWS = torch.zeros(0, dtype=torch.int64)


def _lora_mapping(lora: Any) -> tuple[torch.Tensor | None, ...]:
    """A step's :class:`~minivllm.lora.mapping.LoRAMapping` as the C++ loop takes it:
    ``(sorted_tokens, seg_starts, seg_slots)``, or three Nones (no token has an adapter)."""
    if lora is None or not lora.slots:
        return None, None, None
    return lora.sorted_tokens, lora.seg_starts, lora.seg_slots


class LayerStack:
    """The model's forward as one C++ call: everything that does not change per step, bound once.

    Build it with :meth:`build` (it returns the reason instead where it
    cannot run); :meth:`run` takes a step's :class:`~minivllm.metadata.ModelInput`
    and returns the final hidden states, exactly as the model's forward would.
    """

    def __init__(self, model: torch.nn.Module, kv_caches,
                 projections: list[ProjectionKernel]) -> None:
        from minivllm.fast import cpu_ops
        from minivllm.fast import quantization as fast_quantization

        inner = model.model
        attn = inner.layers[0].self_attn
        self.embed = inner.embed_tokens.forward
        self.final_norm = inner.norm.weight
        self.vocab_size = model.config.vocab_size
        # The lookup, the final norm and the LM head run in the same C++ call where they
        # qualify (model_runner_rules; else the model's embedding and compute_logits run).
        self.embedding = embedding_table(model, self.final_norm.dtype)
        head = lm_head_kernel(model)
        self.lm_head = None if isinstance(head, str) else head
        #: Each projection's kernel and tensors, in the order the C++ object binds them.
        self.projections = tuple(projections)
        numbers = kind_numbers()  # the C++ layer stack's own numbering
        norms = [n for l in inner.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
        # LoRA (minivllm.lora.layers): every projection's stacks, slice by slice, bound once
        # (the manager fills their slots in place); a step passes only its token -> slot map.
        stacks = [lora.stack for _, _, lora in projection_loras(model)] \
            if "lora" in model.features else []
        # The W8A8 kernels serve any M (max_rows None); the stack saves host overhead,
        # which matters for decode-sized steps, so they get the quantized GEMVs' limit.
        #: Most rows (tokens in a step) for which every projection is a GEMV.
        self.max_rows = min(fast_quantization.GEMV_MAX_ROWS if p.max_rows is None
                            else p.max_rows for p in projections)
        if self.lm_head is not None and self.lm_head.max_rows is not None:
            self.max_rows = min(self.max_rows, self.lm_head.max_rows)
        ops = cpu_ops.ops()
        # The overload itself: skips the OpOverloadPacket lookup on every call.
        self._decode_layers = ops.decode_layers.default
        # Everything a step reads that does not change, bound once into one C++ object
        # (layer_stack.cpp's LayerStackArgs): a step's call passes ~500 fewer tensors.
        self.bound = torch.classes.minivllm.LayerStackArgs(
            inner.rotary_emb.cos_sin_cache.float().contiguous(),
            bool(inner.rotary_emb.is_neox_style),
            [n.weight for n in norms], [float(n.eps) for n in norms],
            [t for p in projections for t in p.tensors], [numbers[p.kind] for p in projections],
            [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
            # An int8 / fp8 cache's scales, one pair a layer (none for a float cache).
            [kv[2] for kv in kv_caches if len(kv) == 4], [kv[3] for kv in kv_caches if len(kv) == 4],
            [t for s in stacks for t in s.lora_a], [t for s in stacks for t in s.lora_b],
            [t for s in stacks for t in s.scalings],
            [len(s.lora_a) for s in stacks],  # per projection: its slices
            self.embedding, self.final_norm, float(inner.norm.eps),
            [] if self.lm_head is None else list(self.lm_head.tensors),
            -1 if self.lm_head is None else numbers[self.lm_head.kind])

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches) -> LayerStack | str:
        """The stack for ``model`` over ``kv_caches``, or the reason it cannot run."""
        from minivllm.fast import cpu_ops

        if not kv_caches or kv_caches[0][0].device.type != "cpu":
            return "not on a CPU"
        if not cpu_ops.available():
            return f"the C++ ops did not build ({cpu_ops.unavailable_reason()})"
        unsupported = sorted(model.features - SUPPORTED_FEATURES)
        if unsupported:
            return f"the C++ layer stack does not implement {', '.join(unsupported)}"
        why = components_why_not(model)
        if why is not None:
            return why
        layers = model.model.layers
        if len(layers) != len(kv_caches):
            return "one KV cache a layer"
        # The activations' dtype: a float cache's (an int8 / fp8 cache's scales make 4 tensors).
        dtype = kv_caches[0][0].dtype if len(kv_caches[0]) == 2 else model.model.norm.weight.dtype
        norms = [model.model.norm.weight] + [n.weight for l in layers for n in
                                             (l.input_layernorm, l.post_attention_layernorm)]
        if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
            return "norm weights differ in dtype from the activations"
        if "lora" in model.features:  # add_lora's contract: stacks in the activations' dtype
            stacks = [lora.stack for _, _, lora in projection_loras(model)]
            if any(s is None for s in stacks) or any(
                    t.dtype != dtype or not t.is_contiguous() for s in stacks
                    for t in (*s.lora_a, *s.lora_b)):
                return "LoRA stacks missing, or not contiguous in the activations' dtype"
        # The weights into huge pages (Linux): the step streams them with fewer TLB misses.
        hugepages.rehome(model)
        projections: list[ProjectionKernel] = []
        for layer in layers:
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj):
                got = projection_kernel_of(proj)
                if isinstance(got, str):
                    return got
                projections.append(got)
        return cls(model, kv_caches, projections)

    def can_run(self, model_input: ModelInput) -> bool:
        """True if every projection of this step is a GEMV (few rows) and there is a token."""
        rows = model_input.input_ids.shape[0]
        return 0 < rows <= self.max_rows and model_input.attn_metadata.num_seqs > 0

    @torch.inference_mode()
    def run(self, model_input: ModelInput, logits: bool = False) -> torch.Tensor:
        """The decoder over one step's flat batch; writes its K/V into the caches.

        Returns the final hidden states ``(num_tokens, hidden)``, as the model's forward;
        with ``logits=True`` (only where :attr:`lm_head` is bound) the float32 logits of
        the rows to sample instead, ``(num_logits, vocab)``, as the model's
        ``compute_logits(hidden[model_input.logits_indices])``.
        """
        md = model_input.attn_metadata
        ids = model_input.input_ids
        if self.embedding is not None:  # the lookup runs in C++
            residual = torch.empty(ids.shape[0], self.final_norm.shape[0],
                                   dtype=self.final_norm.dtype)
        else:
            residual = self.embed(ids)  # (T, hidden): the residual stream
        hidden = torch.empty_like(residual)
        out, rows = None, _NO_ROWS
        if logits:
            rows = model_input.logits_indices.to(torch.int64).contiguous()
            out = torch.empty(rows.shape[0], self.lm_head.tensors[0].shape[0],
                              dtype=torch.float32)
        self._decode_layers(
            hidden, residual, ids.to(torch.int64).contiguous(),
            model_input.positions.to(torch.int64).contiguous(),  # (T,)
            md.slot_mapping.to(torch.int64).contiguous(),  # (T,)
            md.block_tables.to(torch.int32),  # (num_seqs, max_blocks)
            md.seq_lens.to(torch.int32),  # (num_seqs,)
            md.query_start_loc.to(torch.int32),  # (num_seqs + 1,)
            self.bound, *_lora_mapping(model_input.lora), out, rows)
        return hidden if out is None else out[:, : self.vocab_size]
