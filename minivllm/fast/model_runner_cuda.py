"""The fast model runner on CUDA: decode steps captured as CUDA graphs, as vLLM does.

A decode step of a small model is a few hundred tiny kernel launches; on a
fast GPU the CPU cannot launch them as quickly as the GPU runs them. A CUDA
graph records the whole forward pass once and replays it with a single
launch.

A graph replays *fixed* shapes and addresses, so:

- batches are padded up to one of a few sizes (1, 2, 4, 8, 16, 32, ...), each
  captured once;
- inputs are copied into static buffers before each replay; padding rows get
  slot ``-1`` (their K/V are not written) and a context of one token;
- attention is captured for the longest context (``max_model_len``): the
  flash-decoding grid has a program for every partition any sequence could
  need, and programs past a sequence's end return at once.

Only decode-only batches (every sequence has one new token) use graphs;
prefills run eagerly. Graphs need kernels that never synchronise with the
host, i.e. the fast (Triton) attention and cache write; the ref twins have
data-dependent shapes (boolean-mask indexing in the cache write, per-sequence
loops planned from the metadata's host copies), which a graph cannot record,
so with them the graphs are not captured (``enforce_eager`` also turns them
off), and the model's own forward runs. A graph records the model's own
forward (:mod:`minivllm.model.llama`): replaying it is that forward, bit for
bit, with the launches taken out.
The static metadata below describes the capture in its host copies; a
replay only refreshes the device buffers.
"""

from __future__ import annotations

import bisect
import logging

import torch

from minivllm.config import cdiv
from minivllm.metadata import AttentionMetadata, ModelInput

logger = logging.getLogger("minivllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (<= 512)."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] < top:
        sizes.append(top)
    return sizes


class CUDAGraphRunner:
    """Replays captured decode forward passes; falls back to eager for anything else.

    Args:
        model: the model (``forward(input_ids, positions, kv_caches, metadata)``).
        kv_caches: the per-layer ``(k_cache, v_cache)`` tensors (fixed addresses).
        max_num_seqs: largest decode batch to capture.
        max_model_len: longest context; sizes the block tables and the attention grid.
        block_size: tokens per KV block.
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_blocks = cdiv(max_model_len, block_size)
        dev = kv_caches[0][0].device
        bs = self.max_bs
        self.input_ids = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(bs, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        # Captured once and replayed with new buffer contents: the host copies
        # describe the capture (bs one-token decodes of up to max_model_len tokens).
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            query_start_loc_host=tuple(range(bs + 1)),
            seq_lens_host=(self.max_model_len,) * bs,
            max_query_len=1, max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, sharing one memory pool."""
        pool = None
        for bs in reversed(self.sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._metadata(bs))
            for _ in range(2):  # warm up: compile the Triton kernels, settle the allocator
                self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("minivllm: captured %d CUDA graphs for decode batches up to %d",
                    len(self.graphs), self.max_bs)

    def can_run(self, model_input: ModelInput) -> bool:
        """True for a decode-only batch that fits the captured sizes."""
        md = model_input.attn_metadata
        n = model_input.input_ids.shape[0]
        return (md.max_query_len == 1 and n == md.num_seqs and n <= self.max_bs
                and md.block_tables.shape[1] <= self.max_blocks)

    def run(self, model_input: ModelInput) -> torch.Tensor:  # (num_tokens, hidden)
        """Copy the batch into the static buffers, replay, return the real rows."""
        md = model_input.attn_metadata
        n = model_input.input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(model_input.input_ids)
        self.positions[:n].copy_(model_input.positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.block_tables[:n, :width].copy_(md.block_tables)
        # Padding rows: no cache write, a one-token context in block 0.
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
