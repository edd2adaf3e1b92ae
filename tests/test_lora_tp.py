"""LoRA under tensor parallelism, every rank simulated in one process.

Each rank's :class:`LoRAManager` (``tp_rank``, ``tp_size``) holds that rank's shard
of every adapter; the base layers are :mod:`minivllm.ref.linear`'s, whose
``weight[r]`` is exactly what rank ``r`` would hold. Checked against the
unsharded (``tp_size=1``) maths:

- column-parallel (``qkv_proj``, ``gate_up_proj``): rank ``r``'s base output plus
  its delta (B's rows sharded, A whole), gathered as the layer gathers, equals
  the dense output plus the dense delta, with KV heads replicated when there are
  more ranks than KV heads;
- row-parallel (``o_proj``, ``down_proj``): the ranks' partial base outputs plus
  their partial deltas (A's columns sharded, B whole), summed as the all-reduce
  sums them, equal the dense result;
- B's shard rows are the very rows the base layer's ``weight_loader`` gives rank
  ``r`` when B is loaded into it as a weight.
"""

from __future__ import annotations

import lora_utils
import pytest
import torch
from conftest import make_tiny_config
from lora_utils import lora_request

from minivllm import backend
from minivllm.lora.manager import LoRAConfig, LoRAManager
from minivllm.lora.mapping import LoRAMapping
from minivllm.lora.models import module_shapes
from minivllm.lora.peft_format import load_adapter
from minivllm.lora.tp import shard_lora
from minivllm.ref import linear as ref_linear

lora_adapters = lora_utils.lora_adapters  # the session fixture (tests/lora_utils.py)

NAMES = ["all_r16", None, "patterns_r8", "layer1_r3", "all_r16", "regex_r1"]
#: (arch, tp_size): llama has 4 heads / 2 KV heads (tp=4 replicates each KV head on 2
#: ranks); qwen2 has 2 heads / 1 KV head (tp=2 replicates it).
CASES = [("llama", 2), ("llama", 4), ("qwen2", 2)]


def managers(arch, adapters, tp_size):
    """The dense manager and one per rank, each after the same step; and the step's mapping."""
    cfg = make_tiny_config(arch)
    requests = [None if n is None else lora_request(adapters, n) for n in NAMES]
    counts = [2, 1, 1, 3, 1, 2]
    out = []
    for rank, size in [(0, 1)] + [(r, tp_size) for r in range(tp_size)]:
        m = LoRAManager(cfg, LoRAConfig(max_loras=4, max_lora_rank=16), tp_rank=rank,
                        tp_size=size)
        batch = m.prepare_step(requests, counts)
        out.append(batch)
    return cfg, out[0], out[1:], sum(counts)


def add(y, x, batch, layer, projection):
    s = batch.stack(layer, projection)
    backend.get("lora").add_lora(y, x, s.lora_a, s.lora_b, s.scalings, batch.mapping,
                                 s.output_slices)
    return y


@pytest.mark.parametrize("arch, tp_size", CASES)
def test_column_parallel_delta_gathers_to_the_dense_one(lora_adapters, arch, tp_size):
    _, adapters = lora_adapters(arch)
    cfg, dense, ranks, t = managers(arch, adapters, tp_size)
    shapes, g = module_shapes(cfg), torch.Generator().manual_seed(0)
    d = shapes["q_proj"][1] // cfg.num_attention_heads
    qkv = ref_linear.QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                       cfg.num_key_value_heads, tp_size=tp_size)
    gate_up = ref_linear.MergedColumnParallelLinear(
        cfg.hidden_size, [cfg.intermediate_size] * 2, tp_size=tp_size)
    weights = {m: torch.randn(shapes[m][1], shapes[m][0], generator=g) for m in shapes}
    for sid, m in zip("qkv", ("q_proj", "k_proj", "v_proj")):
        qkv.weight_loader(qkv.weight, weights[m], sid)
    for sid, m in enumerate(("gate_proj", "up_proj")):
        gate_up.weight_loader(gate_up.weight, weights[m], sid)
    x = torch.randn(t, cfg.hidden_size, generator=g)
    for layer in range(cfg.num_hidden_layers):
        for name, base, keep_kv in (("qkv_proj", qkv, True), ("gate_up_proj", gate_up, False)):
            per_rank = [add(x @ base.weight[r].T, x, ranks[r], layer, name)
                        for r in range(tp_size)]  # each rank: its base rows + its delta rows
            all_ranks = list(range(tp_size))
            keep = ([all_ranks, all_ranks[::qkv.num_kv_head_replicas],
                     all_ranks[::qkv.num_kv_head_replicas]] if keep_kv
                    else [all_ranks, all_ranks])
            gathered = base._gather(per_rank, keep)
            expected = add(base(x), x, dense, layer, name)
            torch.testing.assert_close(gathered, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, tp_size", CASES)
def test_row_parallel_partial_deltas_join_the_all_reduce(lora_adapters, arch, tp_size):
    _, adapters = lora_adapters(arch)
    cfg, dense, ranks, t = managers(arch, adapters, tp_size)
    shapes, g = module_shapes(cfg), torch.Generator().manual_seed(1)
    for name, module in (("o_proj", "o_proj"), ("down_proj", "down_proj")):
        in_features, out_features = shapes[module]
        base = ref_linear.RowParallelLinear(in_features, out_features, tp_size=tp_size)
        base.weight_loader(base.weight, torch.randn(out_features, in_features, generator=g))
        x = torch.randn(t, in_features, generator=g)
        x_shards = x.split(base.input_size_per_partition, dim=-1)  # what each rank receives
        for layer in range(cfg.num_hidden_layers):
            partial = [add(x_shards[r] @ base.weight[r].T, x_shards[r], ranks[r], layer, name)
                       for r in range(tp_size)]
            all_reduced = torch.stack(partial).sum(dim=0)
            expected = add(base(x), x, dense, layer, name)
            torch.testing.assert_close(all_reduced, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, tp_size", CASES)
def test_b_shards_are_the_base_layers_rows(lora_adapters, arch, tp_size):
    """Load B (out, r) into the base column-parallel layer as if it were a weight: rank r's
    slice of it must be exactly :func:`shard_lora`'s B for rank r."""
    _, adapters = lora_adapters(arch)
    cfg = make_tiny_config(arch)
    adapter = load_adapter(lora_request(adapters, "all_r16"), cfg, 16)
    w = {m: adapter.get(0, m) for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    d = module_shapes(cfg)["q_proj"][1] // cfg.num_attention_heads
    qkv = ref_linear.QKVParallelLinear(16, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       tp_size=tp_size)  # "hidden" = the rank r = 16
    for sid, m in zip("qkv", ("q_proj", "k_proj", "v_proj")):
        qkv.weight_loader(qkv.weight, w[m].lora_b, sid)
    gate_up = ref_linear.MergedColumnParallelLinear(16, [cfg.intermediate_size] * 2,
                                                    tp_size=tp_size)
    for sid, m in enumerate(("gate_proj", "up_proj")):
        gate_up.weight_loader(gate_up.weight, w[m].lora_b, sid)
    for r in range(tp_size):
        ours = [shard_lora(m, w[m].lora_a, w[m].lora_b, cfg, r, tp_size) for m in w]
        assert all(torch.equal(a, w[m].lora_a) for (a, _), m in zip(ours, w)), "A replicated"
        assert torch.equal(torch.cat([b for _, b in ours[:3]]), qkv.weight[r])
        assert torch.equal(torch.cat([b for _, b in ours[3:]]), gate_up.weight[r])


def test_bad_rank_is_refused():
    cfg = make_tiny_config("llama")
    with pytest.raises(ValueError, match="tp_rank"):
        shard_lora("q_proj", torch.zeros(2, 64), torch.zeros(64, 2), cfg, 2, 2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_lora("q_proj", torch.zeros(2, 64), torch.zeros(64, 2), cfg, 0, 3)
    assert LoRAMapping.build([]).num_tokens == 0
