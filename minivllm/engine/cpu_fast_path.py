"""The CPU analogue of the CUDA-graph path: the forward pass with the Python taken out.

What you learn here: where the *host overhead* of a small model's decode step
goes, and how to remove most of it without changing a single bit of the result.

At batch 1 a SmolLM2 decode step runs 30 layers of about ten kernels each, and
every kernel is small (a 576-wide RMSNorm is a microsecond of work). The plain
forward (:mod:`minivllm.model.llama`) pays, per kernel, for things that do not
change within a step:

- ``nn.Module.__call__`` (hooks, ``__getattr__`` lookups): ten modules a layer;
- an :func:`~minivllm.model.llama.op_range` check;
- the kernel wrapper's input checks (shapes, dtypes, strides, the metadata's
  layout) and casts (``block_tables.to(int32)``, ``positions.contiguous()``),
  repeated in all 30 layers although the inputs are the same;
- an output allocation per op.

On a GPU the CUDA graph (:mod:`minivllm.engine.cuda_graph`) removes all of
that by replaying the recorded kernels. A CPU has no graph to replay, so this
runner does the next best thing: it checks once, when it is built, that every
kernel component of the model is the C++ CPU op (``torch.ops.minivllm.*``) and
that the weights have the layouts those ops take; it checks the step's
metadata once per step; and then it runs the layer stack as one flat loop that
calls the ops directly, into buffers allocated once per step and reused by all
layers. The linear layers are called through their own ``forward`` (without
``__call__``), so whatever twin serves ``linear`` (the bf16 GEMV, quantized
weights, tensor-parallel shards) runs unchanged.

A decode step (few rows) goes one step further: the same loop, written in
C++, runs every layer in one call (:mod:`minivllm.engine.cpu_layer_stack`),
where every projection is a GEMV anyway; a prefill keeps the Python loop.

It calls the same ops on the same inputs in the same order as the plain
forward, so its output is bit for bit the plain path's
(``tests/test_cpu_fast_path.py`` checks tokens and hidden states). The plain
path stays the readable one; a model whose components are not all the C++ ops
(``backend="ref"``, a student's package) simply runs it. No op ranges are
recorded here: while a profiler records, the worker runs the plain path, so
the op table still names every kernel.
"""

from __future__ import annotations

import torch

from minivllm.engine.cpu_layer_stack import LayerStack
from minivllm.metadata import ModelInput

#: (module attribute holding the component, function name) -> the C++ op it must be.
_REQUIRED = {
    ("layernorm", "fused_add_rms_norm"): "fused_add_rms_norm",
    ("layernorm", "rms_norm"): "rms_norm",
    ("rotary", "apply_rotary_emb"): "rotary_embedding",
    ("cache_write", "reshape_and_cache"): "reshape_and_cache",
    ("attention", "paged_attention"): "paged_attention",
    ("activation", "silu_and_mul"): "silu_and_mul",
}


def _cpp_functions() -> dict[tuple[str, str], set]:
    """The Python functions that are thin wrappers over the C++ ops, per component."""
    from minivllm.fast import activation, attention, cache_write, layernorm, rotary

    mods = dict(layernorm=layernorm, rotary=rotary, cache_write=cache_write,
                attention=attention, activation=activation)
    # ``fast.X.f`` dispatches on the device to ``f_cpu``; ``fast.cpu`` serves ``f_cpu``.
    return {key: {getattr(mods[key[0]], key[1]), getattr(mods[key[0]], key[1] + "_cpu")}
            for key in _REQUIRED}


def why_not(model: torch.nn.Module, kv_caches) -> str | None:
    """None if :class:`CPUFastPath` can run ``model``; otherwise the reason it cannot."""
    from minivllm.fast import cpu_ops

    if not kv_caches or kv_caches[0][0].device.type != "cpu":
        return "not on a CPU"
    if not cpu_ops.available():
        return f"the C++ ops did not build ({cpu_ops.unavailable_reason()})"
    inner = model.model
    if not (getattr(inner, "is_first_rank", True) and getattr(inner, "is_last_rank", True)):
        return "a pipeline stage, not the whole model"
    try:
        layers = model.model.layers
        found = {
            ("layernorm", "fused_add_rms_norm"): [l.input_layernorm.ops.fused_add_rms_norm
                                                  for l in layers],
            ("layernorm", "rms_norm"): [model.model.norm.ops.rms_norm],
            ("rotary", "apply_rotary_emb"): [model.model.rotary_emb.ops.apply_rotary_emb],
            ("cache_write", "reshape_and_cache"): [l.self_attn.ops_cache.reshape_and_cache
                                                   for l in layers],
            ("attention", "paged_attention"): [l.self_attn.ops_attn.paged_attention
                                               for l in layers],
            ("activation", "silu_and_mul"): [l.mlp.ops_act.silu_and_mul for l in layers],
        }
    except AttributeError as e:  # another model layout: run it plainly
        return f"unknown model layout ({e})"
    cpp = _cpp_functions()
    for key, fns in found.items():
        if any(f not in cpp[key] for f in fns):
            return f"{key[0]} is not the C++ op"
    if any(l.self_attn.q_norm is not None for l in layers):
        return "per-head q/k norm (Qwen3) is not in the fast loop"
    dtype = kv_caches[0][0].dtype
    norms = [model.model.norm.weight] + [w for l in layers for w in
                                         (l.input_layernorm.weight,
                                          l.post_attention_layernorm.weight)]
    if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
        return "norm weights differ in dtype from the activations"
    return None


class CPUFastPath:
    """Runs :meth:`LlamaModel.forward <minivllm.model.llama.LlamaModel.forward>` as one flat loop.

    Build it with :meth:`build`, which returns None where it cannot run (see
    :func:`why_not`). :meth:`run` takes a step's
    :class:`~minivllm.metadata.ModelInput` and returns the final hidden states,
    exactly as the plain forward would.
    """

    def __init__(self, model: torch.nn.Module, kv_caches) -> None:
        from minivllm.fast import cpu_ops

        ops = cpu_ops.ops()
        # The overloads themselves: skips the OpOverloadPacket lookup on every call.
        self._rms_norm = ops.rms_norm.default
        self._fused_add_rms_norm = ops.fused_add_rms_norm.default
        self._rope = ops.rotary_embedding.default
        self._cache_write = ops.reshape_and_cache.default
        self._attention = ops.paged_attention.default
        self._silu_and_mul = ops.silu_and_mul.default

        inner = model.model
        self.embed = inner.embed_tokens.forward
        self.final_norm = inner.norm.weight
        self.eps = inner.norm.eps
        rotary = inner.rotary_emb
        self.cos_sin_cache = rotary.cos_sin_cache.float().contiguous()
        self.is_neox = bool(rotary.is_neox_style)
        attn0 = inner.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_dim, self.scale = attn0.head_dim, attn0.scale
        self.q_size, self.kv_size = attn0.q_size, attn0.kv_size
        self.dtype = kv_caches[0][0].dtype
        # One tuple per layer: everything the loop reads, bound once.
        self.layers = [
            (layer.input_layernorm.weight, layer.input_layernorm.eps,
             layer.self_attn.qkv_proj.forward, k_cache, v_cache, layer.self_attn.o_proj.forward,
             layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
             layer.mlp.gate_up_proj.forward, layer.mlp.down_proj.forward)
            for layer, (k_cache, v_cache) in zip(inner.layers, kv_caches)
        ]
        # Decode steps (few rows) can run the whole loop in C++ (csrc/layer_stack.cpp).
        self.stack = LayerStack.build(inner.layers, kv_caches)

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches) -> CPUFastPath | None:
        """The fast path for ``model`` over ``kv_caches``, or None where it cannot run."""
        if why_not(model, kv_caches) is not None:
            return None
        return cls(model, kv_caches)

    @torch.inference_mode()
    def run(self, model_input: ModelInput) -> torch.Tensor:  # (num_tokens, hidden)
        """The decoder over one step's flat batch; writes its K/V into the caches."""
        md = model_input.attn_metadata
        positions = model_input.positions.to(torch.int64).contiguous()  # (T,)
        slot_mapping = md.slot_mapping.to(torch.int64).contiguous()  # (T,)
        block_tables = md.block_tables.to(torch.int32)  # (num_seqs, max_blocks)
        seq_lens = md.seq_lens.to(torch.int32)  # (num_seqs,)
        query_start_loc = md.query_start_loc.to(torch.int32)  # (num_seqs + 1,)
        T = model_input.input_ids.shape[0]
        if T == 0 or md.num_seqs == 0:
            raise ValueError("the fast path needs at least one token and one sequence")
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = self.q_size, self.kv_size
        scale, neox, cos_sin = self.scale, self.is_neox, self.cos_sin_cache
        rms_norm, fused_add = self._rms_norm, self._fused_add_rms_norm
        rope, cache_write, attention = self._rope, self._cache_write, self._attention
        silu_and_mul = self._silu_and_mul

        residual = self.embed(model_input.input_ids)  # (T, hidden): the residual stream
        hidden = torch.empty_like(residual)
        if self.stack is not None and T <= self.stack.max_rows:  # a decode step: one C++ call
            self.stack.run(hidden, residual, positions, slot_mapping, block_tables, seq_lens,
                           query_start_loc, cos_sin, neox, H, H_kv, D, scale)
            fused_add(hidden, residual, self.final_norm, self.eps)
            return hidden
        attn_out = torch.empty(T, H, D, dtype=self.dtype)  # reused by every layer
        act = None
        for i, (w_in, eps_in, qkv_proj, k_cache, v_cache, o_proj, w_post, eps_post,
                gate_up_proj, down_proj) in enumerate(self.layers):
            if i == 0:  # the embeddings are the residual stream
                rms_norm(hidden, residual, w_in, eps_in)
            else:  # residual += hidden; hidden = norm(residual), both in place
                fused_add(hidden, residual, w_in, eps_in)
            qkv = qkv_proj(hidden)  # (T, (H + 2 H_kv) D)
            q = qkv[:, :q_size].view(T, H, D)
            k = qkv[:, q_size : q_size + kv_size].view(T, H_kv, D)
            v = qkv[:, q_size + kv_size :].view(T, H_kv, D)
            rope(positions, q, k, cos_sin, neox)  # in place
            cache_write(k, v, k_cache, v_cache, slot_mapping)
            attention(attn_out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      scale)
            hidden = o_proj(attn_out.view(T, q_size))  # (T, hidden)
            fused_add(hidden, residual, w_post, eps_post)
            gate_up = gate_up_proj(hidden)  # (T, 2 * inter)
            if act is None:  # (T, inter), reused by every layer
                act = torch.empty(T, gate_up.shape[-1] // 2, dtype=gate_up.dtype)
            silu_and_mul(act, gate_up)
            hidden = down_proj(act)  # (T, hidden)
        fused_add(hidden, residual, self.final_norm, self.eps)
        return hidden
