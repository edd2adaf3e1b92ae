"""Pipeline parallelism's layer split and each stage's forward, against two oracles.

Neither oracle is the code under test:

- the split rule, written out here from its statement (``L // P`` layers per
  stage, the ``L % P`` left over one each to the stages just before the last,
  which also holds the LM head), against :func:`minivllm.pp_stages.get_pp_indices`;
- transformers: the stages' ``LlamaModel.forward`` chained one after another
  (each stage its own layers and its own KV cache, over a prefill and a decode
  step) must give transformers' logits, and what a stage hands on must add up
  to transformers' residual stream after that stage's last layer.

The stages are built by the model loader with the backend under test; an
explicit partition checks uneven stages whatever the rule says.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import hf_model

from minivllm import backend
from minivllm.metadata import AttentionMetadata
from minivllm.pp_stages import get_pp_indices

BLOCK_SIZE = 4


def rule(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Every stage's ``[start, end)``, from the statement of the rule."""
    extra = num_layers % pp_size  # one each to stages pp_size - 1 - extra .. pp_size - 2
    sizes = [num_layers // pp_size + (pp_size - 1 - extra <= r < pp_size - 1)
             for r in range(pp_size)]
    starts = list(itertools.accumulate([0, *sizes]))
    return list(zip(starts, starts[1:]))


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 7, 12, 30, 32, 61])
def test_get_pp_indices_follows_the_rule(num_layers: int) -> None:
    for pp_size in range(1, min(num_layers, 9) + 1):
        got = [tuple(get_pp_indices(num_layers, r, pp_size)) for r in range(pp_size)]
        assert got == rule(num_layers, pp_size), f"{num_layers} layers on {pp_size} stages"


def test_get_pp_indices_examples() -> None:
    split = lambda L, P: [tuple(get_pp_indices(L, r, P)) for r in range(P)]  # noqa: E731
    assert split(5, 3) == [(0, 2), (2, 4), (4, 5)]  # the last stage has the LM head: fewest
    assert split(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]  # SmolLM2 on 4 stages
    assert split(8, 1) == [(0, 8)]


def _stages(path, pp_size: int, partition: str | None) -> list:
    from minivllm.model.loader import load_model

    components = backend.Components.resolve(None)  # the backend under test
    return [load_model(str(path), dtype=torch.float32, device="cpu", components=components,
                       pp_rank=r, pp_size=pp_size, pp_layer_partition=partition)[0]
            for r in range(pp_size)]


def _kv_caches(model, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer THIS stage holds."""
    inner = model.model
    attn = inner.layers[inner.start_layer].self_attn
    shape = (num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape))
            for _ in range(inner.start_layer, inner.end_layer)]


@pytest.mark.parametrize("arch,num_layers,pp_size,partition", [
    ("llama", 5, 3, None),  # GQA; 5 layers on 3 stages: 2, 2, 1
    ("qwen2", 4, 2, None),  # tied embeddings: the last stage's LM head is the embedding
    ("llama", 5, 2, "1,4"),  # an explicit, uneven partition
])
def test_stages_chained_give_transformers_logits(tiny_model_dir, arch: str, num_layers: int,
                                                 pp_size: int, partition: str | None) -> None:
    path = tiny_model_dir(arch, num_hidden_layers=num_layers)
    stages = _stages(path, pp_size, partition)
    kv = [_kv_caches(m, num_blocks=16) for m in stages]
    hf = hf_model(path)
    g = torch.Generator().manual_seed(num_layers * 10 + pp_size)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 3, 10)]
    blocks = [list(range(4 * i, 4 * i + 4)) for i in range(len(seqs))]  # 16 tokens each
    computed = [0] * len(seqs)
    for step in range(2):  # a prefill, then one decode token each (reads the cache)
        if step:
            for s in seqs:
                s.append(int(torch.randint(0, 256, (1,), generator=g)))
        ids, pos, slots, qlens = [], [], [], []
        for i, s in enumerate(seqs):
            new = range(computed[i], len(s))
            ids += s[computed[i]:]
            pos += new
            slots += [blocks[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
            qlens.append(len(new))
            computed[i] = len(s)
        md = AttentionMetadata.build(qlens, [len(s) for s in seqs],
                                     torch.tensor(blocks, dtype=torch.int32),
                                     torch.tensor(slots, dtype=torch.int64))
        ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
        with torch.no_grad():
            hf_out = [hf(torch.tensor([s]), output_hidden_states=True) for s in seqs]
            sent = None
            for r, model in enumerate(stages):
                out = model.model(ids_t, pos_t, kv[r], md, sent)
                if r == pp_size - 1:
                    break
                # What stage r sends: the residual stream after its last layer, in two parts.
                stream = out["hidden_states"] + out["residual"]  # (T, hidden)
                end, parts = model.model.end_layer, stream.split(qlens)
                for i, s in enumerate(seqs):
                    want = hf_out[i].hidden_states[end][0, len(s) - qlens[i]:]
                    torch.testing.assert_close(parts[i], want, atol=1e-4, rtol=1e-4,
                                               msg=lambda m, r=r, i=i, step=step: (
                                                   f"step {step}, stage {r} sends seq {i}: {m}"))
                sent = out
            last = torch.tensor(list(itertools.accumulate(qlens))) - 1
            logits = stages[-1].compute_logits(out[last])
        want = torch.stack([o.logits[0, -1] for o in hf_out])
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"step {step} logits: {m}")
