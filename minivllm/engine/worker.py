"""``Worker``: one process's model and its slice of the paged KV cache.

With ``tensor_parallel_size=1`` the engine runs a single worker in its own
process. With tensor parallelism each rank runs one (see
``minivllm/engine/executor.py``); each rank holds only its own weight shards
and its own KV heads.
"""

from __future__ import annotations

import torch

from minivllm.metadata import ModelInput


class Worker:
    """Loads the model on one device and runs forward passes over the paged cache.

    Args:
        model: a registered name, an HF model directory or a ``.gguf`` file.
        dtype: weight and activation dtype.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        tp_size: tensor-parallel world size the layers are built for.
    """

    def __init__(self, model: str, dtype: torch.dtype, device: str | torch.device,
                 tp_size: int = 1) -> None:
        from minivllm.model.loader import load_model

        self.device = torch.device(device)
        self.dtype = dtype
        self.model, self.hf_config, self.tokenizer = load_model(
            model, dtype=dtype, device=self.device, tp_size=tp_size
        )
        attn = self.model.model.layers[0].self_attn
        self.num_layers = len(self.model.model.layers)
        self.num_kv_heads = attn.num_kv_heads  # this rank's KV heads
        self.head_dim = attn.head_dim
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bytes_per_block(self, block_size: int) -> int:
        """KV-cache bytes one block costs on this rank, over all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate one ``(num_blocks, block_size, H_kv, D)`` K and V tensor per layer."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput) -> torch.Tensor:
        """Run one forward pass; return ``(num_sampled, vocab)`` float32 logits."""
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches,
            model_input.attn_metadata,
        )  # (num_tokens, hidden)
        return self.model.compute_logits(hidden[model_input.logits_indices])
