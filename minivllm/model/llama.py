"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

One model, read top to bottom like nanoGPT: small modules with shape comments.
It differs from transformers' ``LlamaForCausalLM`` in three ways, all taken
from vLLM:

1. **A batch is one flat stream of tokens.** ``input_ids`` is ``(T,)``: the
   new tokens of many requests (prefill chunks and decodes) concatenated, with
   no padding. ``positions`` says where each token sits in its own sequence,
   and :class:`~minivllm.metadata.AttentionMetadata` says which tokens belong
   to which sequence and where their keys/values live in the paged KV cache.
   Everything except attention is per-token, so only attention looks at it.
2. **Fused projections.** q/k/v is one matmul (``qkv_proj``), gate/up another
   (``gate_up_proj``); :meth:`LlamaForCausalLM.load_weights` fuses the
   checkpoint's separate tensors into them through each parameter's
   ``weight_loader``.
3. **Residual passing.** Each norm is ``fused_add_rms_norm``: it adds the
   previous sub-layer's output to the residual stream and normalises in one
   kernel, instead of ``x = x + f(norm(x))`` in two.

Variants are switched by the HF config:

- GQA: ``num_key_value_heads < num_attention_heads``.
- Qwen2: bias on q/k/v (not on o_proj).
- Qwen3: ``head_dim`` from the config (may differ from hidden / heads) and an
  RMSNorm over each query and key head before RoPE (``q_norm``/``k_norm``).
- ``tie_word_embeddings``: the LM head reuses the embedding matrix.
- Mistral: Llama here. Every token attends to its whole context, which equals
  sliding-window attention up to the window, so the engine caps ``max_model_len``
  at ``sliding_window`` (4096 for Mistral 7B v0.1; null later; docs/models.md).

**Features, declared.** Every module records, in ``self.features``, the
switches it took from the config (``"gqa"``, ``"qkv_bias"``, ``"qk_norm"``,
``"tensor_parallel"``, ...), and :class:`LlamaForCausalLM` collects them
(``"lora"`` joins when :func:`minivllm.lora.layers.enable_lora` gives every
projection's :class:`~minivllm.lora.layers.ProjectionLoRA` its adapter stacks). The
fast model runner (:mod:`minivllm.fast.model_runner`) runs a model only if it
implements every feature the model declares, and runs this forward
otherwise; so a switch added here must be declared here too, or a fast path
would compute it wrongly (``tests/test_model_runner.py`` checks every
registered architecture bit for bit).

The kernels come from the swap layer (:mod:`minivllm.backend`): the engine's
:class:`~minivllm.backend.Components` record is passed to every layer when the
model is built, so ``ref`` and ``fast`` run the same model code.

Each kernel call sits in an :func:`~minivllm.profiler.op_range` (``op.linear``, ``op.attention``,
...) and each decoder layer in a ``layer.{i}`` range; they exist only while a
torch profiler records (:class:`minivllm.Profiler` sums them into its op table).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm import backend
from minivllm.hf_config import attention_config
from minivllm.lora.layers import LoRAMapping, ProjectionLoRA
from minivllm.metadata import AttentionMetadata
from minivllm.model.rope import get_rope, rope_params_from_config
from minivllm.model.weights import load_hf_weights
from minivllm.pp_stages import IntermediateTensors, PPMissingLayer
from minivllm.profiler import op_range

# (k_cache, v_cache), each (blocks, bs, H_kv, D); an int8 / fp8 cache adds
# (k_scale, v_scale), each (blocks, bs, H_kv) float32 (minivllm/kv_quant.py).
KVCache = tuple[torch.Tensor, ...]


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale; the arithmetic is the backend's ``layernorm``."""

    def __init__(self, hidden_size: int, eps: float,
                 components: backend.Components | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.ops = backend.as_components(components).layernorm
        self.features = frozenset({"rms_norm"})

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` if a residual is given."""
        with op_range("op.norm"):
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps)
            return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Holds the ``cos_sin_cache`` and applies RoPE with the backend's ``rotary``."""

    def __init__(self, config: Any, head_dim: int,
                 components: backend.Components | None = None) -> None:
        super().__init__()
        theta, scaling, partial = rope_params_from_config(config)
        self.rotary_dim = int(head_dim * partial)
        self.is_neox_style = True  # HF-format Llama/Qwen checkpoints "rotate half"
        cache = get_rope(head_dim, self.rotary_dim, config.max_position_embeddings, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # (max_pos, rotary_dim)
        self.ops = backend.as_components(components).rotary

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with op_range("op.rope"):
            return self.ops.apply_rotary_emb(positions, q, k, self.cos_sin_cache,
                                             self.is_neox_style)


class LlamaAttention(nn.Module):
    """qkv_proj -> [q/k norm] -> RoPE -> write K/V to the paged cache -> attend -> o_proj."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp_size: int,
                 components: backend.Components | None = None) -> None:
        super().__init__()
        components = backend.as_components(components)
        hidden = config.hidden_size
        dims = attention_config(config)
        total_heads, total_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        qkv_bias, o_bias = dims.qkv_bias, dims.o_bias

        linear = components.linear
        self.qkv_proj = linear.QKVParallelLinear(hidden, self.head_dim, total_heads,
                                                 total_kv_heads, bias=qkv_bias, tp_size=tp_size)
        # The head counts this process computes: the totals when one process plays every
        # rank (minivllm.ref.linear), this rank's share when each rank is a process.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = linear.RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias,
                                               tp_size=tp_size)
        # Each projection's LoRA: its adapters' delta after the base matmul (minivllm.lora).
        self.qkv_lora = ProjectionLoRA("qkv_proj", components.lora)
        self.o_lora = ProjectionLoRA("o_proj", components.lora)
        if dims.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, components)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, components)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared by all layers
        self.scale = self.head_dim**-0.5
        self.ops_cache = components.cache_write
        self.ops_attn = components.attention
        self.features = frozenset(
            {"qkv_proj", "rope", "paged_attention", "o_proj"}
            | ({"gqa"} if total_kv_heads < total_heads else set())
            | ({"qkv_bias"} if qkv_bias else set()) | ({"o_bias"} if o_bias else set())
            | ({"qk_norm"} if self.q_norm is not None else set()))

    def forward(
        self,
        positions: torch.Tensor,  # (T,)
        hidden: torch.Tensor,  # (T, hidden)
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        lora: LoRAMapping | None = None,  # each token's adapter slot; None: no adapter
    ) -> torch.Tensor:  # (T, hidden)
        T = hidden.shape[0]
        with op_range("op.linear"):  # qkv_proj(hidden) + each token's LoRA delta
            qkv = self.qkv_lora(self.qkv_proj, hidden, lora)  # (T, (H + 2 * H_kv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        if self.q_norm is not None:  # Qwen3: normalise each head before rotating it
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
        # q, k and v stay strided views of qkv (no copies): every twin of RoPE, the
        # cache write and attention takes any token/head strides with unit stride on D.
        q, k = self.rotary_emb(positions, q, k)

        k_cache, v_cache, *scales = kv_cache
        quant = dict(zip(("k_scale", "v_scale"), scales))  # an int8 / fp8 cache's; else none
        with op_range("op.cache_write"):
            self.ops_cache.reshape_and_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping,
                                             **quant)
        with op_range("op.attention"):
            out = self.ops_attn.paged_attention(q, k_cache, v_cache, attn_metadata, self.scale,
                                                **quant)
        with op_range("op.linear"):  # (T, H, D) -> (T, hidden)
            return self.o_lora(self.o_proj, out.reshape(T, self.q_size), lora)


class LlamaMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with gate and up fused."""

    def __init__(self, config: Any, tp_size: int,
                 components: backend.Components | None = None) -> None:
        super().__init__()
        components = backend.as_components(components)
        linear = components.linear
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = linear.MergedColumnParallelLinear(config.hidden_size, [inter, inter],
                                                              bias=bias, tp_size=tp_size)
        self.down_proj = linear.RowParallelLinear(inter, config.hidden_size, bias=bias,
                                                  tp_size=tp_size)
        self.gate_up_lora = ProjectionLoRA("gate_up_proj", components.lora)
        self.down_lora = ProjectionLoRA("down_proj", components.lora)
        self.ops_act = components.activation
        self.features = frozenset({"silu_gated_mlp"} | ({"mlp_bias"} if bias else set()))

    def forward(self, x: torch.Tensor,  # (T, hidden) -> (T, hidden)
                lora: LoRAMapping | None = None) -> torch.Tensor:
        with op_range("op.linear"):  # each projection plus each token's LoRA delta
            gate_up = self.gate_up_lora(self.gate_up_proj, x, lora)  # (T, 2 * inter)
        with op_range("op.activation"):
            act = self.ops_act.silu_and_mul(gate_up)  # (T, inter)
        with op_range("op.linear"):
            return self.down_lora(self.down_proj, act, lora)  # (T, inter) -> (T, hidden)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, tp_size: int,
                 components: backend.Components | None = None) -> None:
        super().__init__()
        components = backend.as_components(components)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, components)
        self.self_attn = LlamaAttention(config, rotary_emb, tp_size, components)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, components)
        self.mlp = LlamaMLP(config, tp_size, components)
        self.features = (self.input_layernorm.features | self.self_attn.features
                         | self.post_attention_layernorm.features | self.mlp.features)

    def forward(
        self,
        positions: torch.Tensor,  # (T,)
        hidden: torch.Tensor,  # (T, hidden): the previous layer's output
        residual: torch.Tensor | None,  # (T, hidden): the stream before it; None in layer 0
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        lora: LoRAMapping | None = None,  # each token's adapter slot; None: no adapter
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # layer 0: the embeddings are the residual stream
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata, lora)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora), residual


class LlamaModel(nn.Module):
    """Embedding, the decoder layers, and the final norm (no LM head).

    With pipeline parallelism (``pp_rank`` of ``pp_size``) it holds only the
    layers ``start_layer .. end_layer - 1`` of ``layer_range``; the embedding
    lives on the first stage (and on the last, when the LM head is tied to
    it), the final norm on the last. Everything else is a :class:`PPMissingLayer`.
    """

    def __init__(self, config: Any, tp_size: int,
                 components: backend.Components | None = None,
                 layer_range: tuple[int, int] | None = None, pp_rank: int = 0,
                 pp_size: int = 1) -> None:
        super().__init__()
        components = backend.as_components(components)
        linear = components.linear
        num_layers = config.num_hidden_layers
        self.start_layer, self.end_layer = layer_range or (0, num_layers)
        self.is_first_rank, self.is_last_rank = pp_rank == 0, pp_rank == pp_size - 1
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.is_first_rank or (self.is_last_rank and tied):
            self.embed_tokens = linear.VocabParallelEmbedding(config.vocab_size,
                                                              config.hidden_size, tp_size=tp_size)
        else:
            self.embed_tokens = PPMissingLayer()
        self.rotary_emb = RotaryEmbedding(config, attention_config(config).head_dim, components)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, tp_size, components)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(num_layers))
        self.norm = (RMSNorm(config.hidden_size, config.rms_norm_eps, components)
                     if self.is_last_rank else PPMissingLayer())
        held = [self.layers[i] for i in range(self.start_layer, self.end_layer)]
        self.features = frozenset().union(
            *(layer.features for layer in held),
            {"embedding"} if self.is_first_rank else (),
            {"final_norm"} if self.is_last_rank else (),
            {"pipeline_stage"} if pp_size > 1 else (),
            {"tensor_parallel"} if tp_size > 1 else ())

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[KVCache],  # one per layer this stage holds
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,  # None on the first stage
        lora: LoRAMapping | None = None,  # each token's adapter slot; None: no adapter
    ) -> torch.Tensor | IntermediateTensors:
        """This stage's forward over ``T`` tokens: the first embeds, each runs its layers
        ``[start_layer, end_layer)`` (``kv_caches[0]`` is ``start_layer``'s), the last norms
        and returns ``(T, hidden)``; the others return what they send on."""
        if self.is_first_rank:
            with op_range("op.embedding"):
                hidden = self.embed_tokens(input_ids)  # (T, hidden)
            residual = None  # layer 0 takes the embeddings as the residual stream
        else:
            hidden = intermediate_tensors["hidden_states"]  # (T, hidden)
            residual = intermediate_tensors["residual"]  # (T, hidden)
        for i in range(self.start_layer, self.end_layer):
            with op_range(f"layer.{i}"):
                hidden, residual = self.layers[i](positions, hidden, residual,
                                                  kv_caches[i - self.start_layer], attn_metadata,
                                                  lora)
        if not self.is_last_rank:
            return IntermediateTensors(hidden_states=hidden, residual=residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    Args:
        config: the HF ``PretrainedConfig`` (``transformers.AutoConfig``).
        tp_size: tensor-parallel world size, passed to every linear layer.
        components: the engine's :class:`~minivllm.backend.Components`, passed
            to every layer; None resolves the global spec once, here.
    """

    def __init__(self, config: Any, tp_size: int = 1,
                 components: backend.Components | None = None,
                 layer_range: tuple[int, int] | None = None, pp_rank: int = 0,
                 pp_size: int = 1) -> None:
        super().__init__()
        components = backend.as_components(components)
        self.config = config
        self.tp_size = tp_size
        self.model = LlamaModel(config, tp_size, components, layer_range, pp_rank, pp_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        linear = components.linear
        if not self.model.is_last_rank:
            self.lm_head = PPMissingLayer()  # logits are the last stage's business
        else:
            self.lm_head = linear.ParallelLMHead(config.vocab_size, config.hidden_size,
                                                 tp_size=tp_size)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight  # one shared matrix
        #: Every feature this model's forward uses, by name (see the module docstring).
        self.features: frozenset[str] = self.model.features | (
            {"tied_embeddings"} if self.tie_word_embeddings else set())

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer (of this stage)
        attn_metadata: AttentionMetadata,
        intermediate_tensors: Any = None,  # from the previous pipeline stage
        lora: LoRAMapping | None = None,  # the step's token -> LoRA slot map (minivllm.lora)
    ) -> Any:  # (T, hidden), or IntermediateTensors on a stage before the last
        """Run the decoder (this stage's layers) over a flat batch; write its K/V into ``kv_caches``."""
        num_layers = self.model.end_layer - self.model.start_layer
        if len(kv_caches) != num_layers:
            raise ValueError(f"kv_caches must have one (k, v) pair per layer ({num_layers}), "
                             f"got {len(kv_caches)}")
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors,
                          lora)

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """This model cut after its first ``num_layers`` decoder layers (a view, no copy).

        The view runs the embedding, layers ``0 .. num_layers - 1``, the final
        norm and the LM head, all of them the very modules (and weights) of
        this model: LayerSkip-style self-speculation, where the early exit is
        the draft model (:mod:`minivllm.spec_decode.draft_model`). Its forward
        takes ``kv_caches[:num_layers]``; since those layers are this model's,
        the K/V they write are exactly what this model writes there.
        """
        total = len(self.model.layers)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
                or not 1 <= num_layers <= total:
            raise ValueError(f"num_draft_layers must be an int in [1, {total}] (the model's "
                             f"layers), got {num_layers!r}")
        cls = type(self)
        # Built without __init__ (no parameter allocated): every submodule is this model's.
        inner = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(inner)
        inner.embed_tokens = self.model.embed_tokens
        inner.rotary_emb = self.model.rotary_emb
        inner.layers = self.model.layers[:num_layers]  # a new ModuleList of the same layers
        inner.norm = self.model.norm
        # One stage of layers 0 .. num_layers - 1: it embeds, runs those, applies the norm.
        inner.start_layer, inner.end_layer = 0, num_layers
        inner.is_first_rank = inner.is_last_rank = True
        inner.features = self.model.features
        view = cls.__new__(cls)
        nn.Module.__init__(view)
        view.config, view.tp_size = self.config, self.tp_size
        view.tie_word_embeddings = self.tie_word_embeddings
        view.features = self.features
        view.model = inner
        view.lm_head = self.lm_head
        return view

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, V)
        """Project hidden states (usually each sequence's last token) to float32 logits
        (with tensor parallelism, all-gathered: every rank has them)."""
        with op_range("op.lm_head"):
            logits = self.lm_head(hidden)
        return logits[..., : self.config.vocab_size].float()  # drop any TP vocab padding

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into our (fused) parameters; their names.

        Skips what the checkpoint may carry that this model does not hold: old RoPE buffers, a
        tied LM head (the embedding) and other stages' tensors; the rest is ``load_hf_weights``.
        """
        def skip(name: str) -> bool:
            return ("rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name
                    or (name == "lm_head.weight" and self.tie_word_embeddings)
                    or self.is_pp_missing(name))

        return load_hf_weights(self, weights, skip)

    def is_pp_missing(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a module of another pipeline stage."""
        inner = self.model
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return not inner.start_layer <= layer < inner.end_layer
        module = {"model.embed_tokens.": inner.embed_tokens, "model.norm.": inner.norm,
                  "lm_head.": self.lm_head}
        return any(name.startswith(p) and isinstance(m, PPMissingLayer)
                   for p, m in module.items())


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with a bias on q/k/v (switched on by ``model_type``)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm and an explicit ``head_dim``."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's architecture; max_model_len is capped at ``sliding_window`` (see above)."""
