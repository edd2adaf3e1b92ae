"""LoRA against PEFT: our fused base projection + our delta equals PEFT's module output.

Oracle: ``peft`` itself. Tiny random Llama and Qwen2 models (``conftest``) get six
PEFT adapters (``lora_utils.ADAPTERS``: ranks 1 to 16, target lists and a regex,
rsLoRA, rank/alpha patterns, ``layers_to_transform``), saved by
``save_pretrained`` and loaded back by PEFT's own loader. Our side reads the
same files with :mod:`minivllm.lora.peft_format`, puts them in slots with
:class:`~minivllm.lora.manager.LoRAManager`, and runs one mixed batch per step
through our model's *fused* projections (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``) plus the ``lora`` component under test. Every
token must get exactly what PEFT's separate ``q_proj`` / ``k_proj`` / ...
modules give with that token's adapter active (or with adapters disabled).
"""

from __future__ import annotations

import lora_utils
import pytest
import torch
from lora_utils import lora_request, peft_model

from minivllm import backend
from minivllm.lora.manager import LoRAConfig, LoRAManager
from minivllm.lora.models import PACKED_MODULES_MAPPING, SUPPORTED_MODULES, module_shapes
from minivllm.lora.peft_format import load_adapter
from minivllm.model import load_model

lora_adapters = lora_utils.lora_adapters  # the session fixture (tests/lora_utils.py)

ATOL = RTOL = 2e-5  # float32 throughout; our GEMMs sum in another order than PEFT's


def peft_module(oracle, layer: int, module: str) -> torch.nn.Module:
    """PEFT's ``q_proj`` (etc.) of decoder layer ``layer``: a ``lora.Linear`` or the plain layer."""
    decoder = oracle.base_model.model.model.layers[layer]
    return getattr(getattr(decoder, SUPPORTED_MODULES[module]), module)


def peft_outputs(oracle, layer: int, module: str, x: torch.Tensor, names: list) -> torch.Tensor:
    """Row ``t`` = PEFT's ``module(x[t])`` with adapter ``names[t]`` active (None: disabled)."""
    mod = peft_module(oracle, layer, module)
    rows = torch.empty(x.shape[0], module_shapes(oracle.config)[module][1])
    with torch.no_grad():
        for name in dict.fromkeys(names):
            picked = [t for t, n in enumerate(names) if n == name]
            if name is None:
                with oracle.disable_adapter():
                    rows[picked] = mod(x[picked])
            else:
                oracle.set_adapter(name)
                rows[picked] = mod(x[picked])
    return rows


def our_projection(model, layer: int, projection: str):
    decoder = model.model.layers[layer]
    parent = decoder.self_attn if projection in ("qkv_proj", "o_proj") else decoder.mlp
    return getattr(parent, projection)


#: Three steps over the six adapters with four slots: later steps evict and reuse slots
#: (step 2 refills all_r16's rank-16 slot with layer1_r3: no stale rows may survive).
STEPS = [
    ["all_r16", None, "qv_r4", "all_r16", "mlp_rslora_r8", "regex_r1", None],
    ["layer1_r3", "patterns_r8", None, "qv_r4", "layer1_r3"],
    ["all_r16", "regex_r1", "mlp_rslora_r8", None, "patterns_r8"],
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_matches_peft_per_token(lora_adapters, arch):
    base, adapters = lora_adapters(arch)
    oracle = peft_model(base, adapters)
    model, hf_config, _ = load_model(base)
    manager = LoRAManager(hf_config, LoRAConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=5))
    ops = backend.get("lora")
    g = torch.Generator().manual_seed(0)
    for step, names in enumerate(STEPS):
        counts = torch.randint(1, 4, (len(names),), generator=g).tolist()
        requests = [None if n is None else lora_request(adapters, n) for n in names]
        batch = manager.prepare_step(requests, counts)
        token_names = [n for n, c in zip(names, counts) for _ in range(c)]
        for layer in range(hf_config.num_hidden_layers):
            for projection, modules in PACKED_MODULES_MAPPING.items():
                in_features = module_shapes(hf_config)[modules[0]][0]
                x = torch.randn(len(token_names), in_features, generator=g)
                with torch.no_grad():
                    y = our_projection(model, layer, projection)(x)  # (T, fused out)
                s = batch.stack(layer, projection)
                ops.add_lora(y, x, s.lora_a, s.lora_b, s.scalings, batch.mapping, s.output_slices)
                expected = torch.cat([peft_outputs(oracle, layer, m, x, token_names)
                                      for m in modules], dim=1)
                torch.testing.assert_close(
                    y, expected, atol=ATOL, rtol=RTOL,
                    msg=lambda m: f"step {step}, layer {layer}, {projection}: {m}")  # noqa: B023


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_delta_is_independent_of_the_base_weight_format(lora_adapters, quantization):
    """With int8 / int4 base weights the delta still works on x: ours adds exactly
    PEFT's ``module(x) - base_layer(x)`` to the quantized projection's output."""
    base, adapters = lora_adapters("llama")
    oracle = peft_model(base, adapters)
    model, hf_config, _ = load_model(base, quantization=quantization)
    manager = LoRAManager(hf_config, LoRAConfig(max_loras=2, max_lora_rank=16))
    names = ["all_r16", None, "patterns_r8", "all_r16"]
    batch = manager.prepare_step([None if n is None else lora_request(adapters, n) for n in names],
                                 [1] * len(names))
    ops = backend.get("lora")
    g = torch.Generator().manual_seed(1)
    for projection, modules in PACKED_MODULES_MAPPING.items():
        x = torch.randn(len(names), module_shapes(hf_config)[modules[0]][0], generator=g)
        with torch.no_grad():
            y = our_projection(model, 1, projection)(x)
        before = y.clone()
        s = batch.stack(1, projection)
        ops.add_lora(y, x, s.lora_a, s.lora_b, s.scalings, batch.mapping, s.output_slices)
        with torch.no_grad():
            delta = torch.cat([peft_outputs(oracle, 1, m, x, names)
                               - peft_outputs(oracle, 1, m, x, [None] * len(names))
                               for m in modules], dim=1)
        torch.testing.assert_close(y - before, delta, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reader_finds_peft_modules_ranks_and_scalings(lora_adapters, arch):
    """Which modules each adapter adapts, and each one's rank and scaling, as PEFT built them
    (target lists, regexes, layers_to_transform, rank/alpha patterns, rsLoRA)."""
    base, adapters = lora_adapters(arch)
    oracle = peft_model(base, adapters)
    hf_config = oracle.config
    for name in adapters:
        ours = load_adapter(lora_request(adapters, name), hf_config, max_lora_rank=16)
        theirs = {}
        for layer in range(hf_config.num_hidden_layers):
            for module in SUPPORTED_MODULES:
                mod = peft_module(oracle, layer, module)
                if hasattr(mod, "lora_A") and name in mod.lora_A:
                    theirs[(layer, module)] = (mod.r[name], mod.scaling[name],
                                               mod.lora_A[name].weight, mod.lora_B[name].weight)
        assert set(ours.loras) == set(theirs), name
        for key, (rank, scaling, a, b) in theirs.items():
            w = ours.loras[key]
            assert (w.rank, w.scaling) == (rank, pytest.approx(scaling)), (name, key)
            assert torch.equal(w.lora_a, a.detach()) and torch.equal(w.lora_b, b.detach())
