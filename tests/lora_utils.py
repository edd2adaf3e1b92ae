"""Tiny models and PEFT adapters for the LoRA tests (not a test module; reusable).

The adapters are made by ``peft`` itself (the independent oracle) on a tiny
random-weight model from ``conftest``: :func:`save_peft_adapter` wraps the model
with ``peft.get_peft_model``, gives every ``lora_A`` and ``lora_B`` random
non-zero values (PEFT initialises B to zero, which would make every delta 0 and
every test pass), and saves it with ``save_pretrained``. :func:`peft_model`
loads a set of saved adapters back *through PEFT's own loader*, so a bug in
minivllm's reader cannot hide on both sides.

:data:`ADAPTERS` is a spread of configurations: ranks 1 to 16, different target
modules (a list, a regex string, only some of q/k/v, only the MLP), rsLoRA,
``rank_pattern`` / ``alpha_pattern`` and ``layers_to_transform``. The fixture
:func:`lora_adapters` (bind it in a test module) saves them once per session
for a tiny model; an engine-level test gets the same directories::

    import lora_utils
    from lora_utils import peft_model
    lora_adapters = lora_utils.lora_adapters  # the fixture (an import would trip ruff F811)

    def test_x(lora_adapters):
        base, adapters = lora_adapters("llama")   # model dir, {name: adapter dir}
        oracle = peft_model(base, adapters)        # oracle.set_adapter(name) ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import save_tiny_model

from minivllm.lora.request import LoRARequest

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> peft.LoraConfig keyword arguments (plus ``seed``). Different ranks, targets,
#: scalings; every one non-trivial on the tiny models (2 decoder layers).
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
    "all_r16": dict(r=16, lora_alpha=16, target_modules=ALL_MODULES, seed=2),
    "mlp_rslora_r8": dict(r=8, lora_alpha=4, use_rslora=True,
                          target_modules=["gate_proj", "up_proj", "down_proj"], seed=3),
    "regex_r1": dict(r=1, lora_alpha=3, target_modules=r".*\.(k_proj|o_proj)", seed=4),
    "patterns_r8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"],
                        rank_pattern={"q_proj": 2, "down_proj": 12},
                        alpha_pattern={"layers.1.self_attn.q_proj": 5}, seed=5),
    "layer1_r3": dict(r=3, lora_alpha=6, target_modules=["o_proj", "up_proj", "v_proj"],
                      layers_to_transform=[1], seed=6),
}


def save_peft_adapter(base_dir: str | Path, out_dir: str | Path, seed: int = 0,
                      **lora_kwargs: Any) -> Path:
    """Make a LoRA adapter for the model in ``base_dir`` with PEFT and save it to ``out_dir``.

    ``lora_kwargs`` go to ``peft.LoraConfig`` (``r``, ``lora_alpha``,
    ``target_modules`` ...). Every A and B gets random values of a size that makes
    the delta comparable to the base projection's output.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                 local_files_only=True)
    peft = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_A." in name:  # (r, in)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:  # (out, r)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    peft.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_model(base_dir: str | Path, adapters: dict[str, Path]) -> Any:
    """The tiny model with every adapter loaded by PEFT (``set_adapter(name)`` picks one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                attn_implementation="eager",
                                                local_files_only=True)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


def lora_request(adapters: dict[str, Path], name: str) -> LoRARequest:
    """A :class:`LoRARequest` for adapter ``name`` (its id: its position in ``adapters`` + 1)."""
    return LoRARequest(name, list(adapters).index(name) + 1, str(adapters[name]))


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory):
    """Factory ``lora_adapters(arch) -> (base model dir, {name: adapter dir})`` for the
    tiny model ``arch`` of ``conftest.TINY_CONFIGS``, with every adapter of :data:`ADAPTERS`."""
    pytest.importorskip("peft", reason="the LoRA oracle tests need the peft package")
    cache: dict[str, tuple[Path, dict[str, Path]]] = {}

    def make(arch: str = "llama") -> tuple[Path, dict[str, Path]]:
        if arch not in cache:
            base = save_tiny_model(tmp_path_factory.mktemp(f"lora_base_{arch}"), arch, seed=7)
            root = tmp_path_factory.mktemp(f"lora_adapters_{arch}")
            adapters = {name: save_peft_adapter(base, root / name, **kw)
                        for name, kw in ADAPTERS.items()}
            cache[arch] = (base, adapters)
        return cache[arch]

    return make
