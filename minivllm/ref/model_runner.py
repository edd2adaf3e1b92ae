"""The model runner: how one step's forward pass runs, readable version.

A worker builds one :class:`ModelRunner` over its model and its KV cache once
the cache exists (:meth:`~minivllm.worker.worker.Worker.init_kv_cache`), and
calls :meth:`ModelRunner.execute_model` once per step with the step's
:class:`~minivllm.metadata.ModelInput`. Here that call is the model's own
forward, nothing else: the code a reader opens in
:mod:`minivllm.model.llama` is the code that runs, and a breakpoint in
``LlamaDecoderLayer.forward`` fires on every step.

The fast twin (:mod:`minivllm.fast.model_runner`) runs the *same* forward
with the per-kernel host overhead taken out (a CUDA graph replayed on a GPU,
the whole layer stack in one C++ call on a CPU), proven bit-identical to
this one, and falls back to it for anything it does not support.
``enforce_eager=True`` makes the fast twin behave exactly like this one.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.metadata import ModelInput

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs a model's forward pass over its paged KV cache, one step at a time.

    Args:
        model: a :class:`~minivllm.model.llama.LlamaForCausalLM` (or a
            pipeline stage of one, or a ``first_layers`` view of one).
        kv_caches: one ``(k_cache, v_cache)`` pair per layer the model holds.
        max_num_seqs: the most sequences a step can hold (what a CUDA graph
            would be captured for; unused here).
        max_model_len: the longest sequence (likewise).
        block_size: tokens per KV block (likewise).
        enforce_eager: always run the model's own forward (the only way here).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 *, max_num_seqs: int = 256, max_model_len: int | None = None,
                 block_size: int = 16, enforce_eager: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches

    @property
    def fast_paths(self) -> tuple[str, ...]:
        """The faster ways this runner has to run the same forward: none here."""
        return ()

    def describe(self) -> str:
        """How the forward runs, in words (the engine logs it at start-up)."""
        return "the model's own forward"

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput, intermediate_tensors: Any = None) -> Any:
        """The model's forward over one step: ``(num_tokens, hidden)`` final hidden states.

        On a pipeline stage before the last it takes the previous stage's
        ``intermediate_tensors`` (None on the first) and returns its own
        :class:`~minivllm.pp_stages.IntermediateTensors`. The step's K/V are
        written into the cache on the way; ``model_input.lora`` (each token's LoRA
        slot, or None) goes to the forward, which adds the adapters' deltas.
        """
        return self.model(model_input.input_ids, model_input.positions, self.kv_caches,
                          model_input.attn_metadata, intermediate_tensors, model_input.lora)

    @torch.inference_mode()
    def execute_model_logits(self, model_input: ModelInput,
                             intermediate_tensors: Any = None) -> torch.Tensor:
        """The forward (on the last pipeline stage), then the logits of the rows to sample:
        ``(num_logits, vocab)`` float32, ``model.compute_logits`` of the final hidden
        states at ``model_input.logits_indices`` (each sequence's last row, or every row
        a step verifies or scores)."""
        hidden = self.execute_model(model_input, intermediate_tensors)
        return self.model.compute_logits(hidden[model_input.logits_indices])
