"""``Worker``: one process's model and its slice of the paged KV cache.

With ``tensor_parallel_size=1`` the engine runs a single worker in its own
process. With tensor parallelism each rank runs one (see
``minivllm/engine/executor.py``); each rank holds only its own weight shards
and its own KV heads.
"""

from __future__ import annotations

import logging

import torch

from minivllm.metadata import ModelInput

logger = logging.getLogger("minivllm")


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
        self.graph_runner = None  # a CUDAGraphRunner once decode graphs are captured

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

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int) -> bool:
        """Capture decode steps as CUDA graphs (see ``cuda_graph.py``); True on success.

        Needs a CUDA device and the fast attention and cache-write kernels (the
        ref twins synchronise with the host, which a graph cannot record). Any
        failure leaves the worker running eagerly, with a warning.
        """
        from minivllm import backend
        from minivllm.engine.cuda_graph import CUDAGraphRunner

        if self.device.type != "cuda":
            return False
        if any(backend.resolve(c) != "fast" for c in ("attention", "cache_write")):
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

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput) -> torch.Tensor | None:
        """Run one forward pass; return ``(num_sampled, vocab)`` float32 logits.

        Tensor-parallel ranks other than 0 return None (the logits are gathered
        to rank 0).
        """
        if self.graph_runner is not None and self.graph_runner.can_run(model_input):
            hidden = self.graph_runner.run(model_input)
        else:
            hidden = self.model(
                model_input.input_ids, model_input.positions, self.kv_caches,
                model_input.attn_metadata,
            )  # (num_tokens, hidden)
        return self.model.compute_logits(hidden[model_input.logits_indices])
