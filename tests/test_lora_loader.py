"""LoRARequest and the PEFT reader's refusals: every bad adapter fails at load, by name.

Adapters with options minivllm does not implement are made by PEFT itself where
PEFT can make them (DoRA, biases, extra saved modules, embedding and LM-head
targets), so the files are what a user would really hand over; the rest edit a
real adapter's ``adapter_config.json`` or weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lora_utils
import pytest
import torch
from conftest import make_tiny_config
from lora_utils import save_peft_adapter
from safetensors.torch import load_file, save_file

import minivllm
from minivllm.lora.peft_format import load_adapter
from minivllm.lora.request import LoRARequest

lora_adapters = lora_utils.lora_adapters  # the session fixture (tests/lora_utils.py)


def load(path, arch="llama", max_lora_rank=16, **config):
    """Load the adapter at ``path`` for tiny model ``arch``."""
    return load_adapter(LoRARequest("a", 1, str(path)), make_tiny_config(arch, **config),
                        max_lora_rank)


def copy_adapter(src: Path, dst: Path, edit=None, tensors=None) -> Path:
    """A copy of adapter ``src`` with its config edited by ``edit(dict)`` and/or its
    tensors by ``tensors(dict)``."""
    shutil.copytree(src, dst)
    if edit is not None:
        config = json.loads((dst / "adapter_config.json").read_text())
        edit(config)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        weights = load_file(str(dst / "adapter_model.safetensors"))
        tensors(weights)
        save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


# ------------------------------------------------------------------------------ LoRARequest
def test_lora_request_fields_and_export():
    req = minivllm.LoRARequest("sql", 3, Path("/tmp/x"))
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("sql", 3, "/tmp/x")
    assert req.adapter_id == 3 and req.name == "sql" and req.path == "/tmp/x"
    assert minivllm.LoRARequest is LoRARequest


@pytest.mark.parametrize("kwargs, field", [
    (dict(lora_name="", lora_int_id=1, lora_path="/p"), "lora_name"),
    (dict(lora_name=None, lora_int_id=1, lora_path="/p"), "lora_name"),
    (dict(lora_name="a", lora_int_id=0, lora_path="/p"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=-2, lora_path="/p"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=True, lora_path="/p"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=1.0, lora_path="/p"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_path"),
    (dict(lora_name="a", lora_int_id=1, lora_path=7), "lora_path"),
])
def test_lora_request_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)


# ------------------------------------------------------------------------------ paths and files
def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(ValueError, match="no-such-adapter"):
        load(missing)


def test_directory_without_config_or_weights(lora_adapters, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        load(tmp_path / "empty")
    _, adapters = lora_adapters("llama")
    no_weights = copy_adapter(adapters["qv_r4"], tmp_path / "noweights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load(no_weights)


# ------------------------------------------------------------------------------ model fit
def test_rank_above_max_lora_rank_names_it(lora_adapters):
    _, adapters = lora_adapters("llama")
    with pytest.raises(ValueError, match=r"rank 16 .*max_lora_rank=8"):
        load(adapters["all_r16"], max_lora_rank=8)
    with pytest.raises(ValueError, match=r"rank 12 .*max_lora_rank=11"):  # a rank_pattern rank
        load(adapters["patterns_r8"], max_lora_rank=11)
    assert load(adapters["patterns_r8"], max_lora_rank=12).rank == 12


def test_adapter_for_another_model_shape(lora_adapters):
    _, adapters = lora_adapters("llama")  # hidden 64; the qwen2 tiny model has hidden 80
    with pytest.raises(ValueError, match="another model"):
        load(adapters["qv_r4"], arch="qwen2")
    with pytest.raises(ValueError, match="layer 1, but the model has 1 layers"):
        load(adapters["qv_r4"], num_hidden_layers=1)


@pytest.mark.parametrize("targets, match", [
    (["q_proj", "fc1"], "unknown target module 'fc1'"),
    (["q_proj", "lm_head"], "LM head"),
    (["model.embed_tokens"], "embedding"),
    (r".*(q_proj|lm_head)", "matches 'lm_head'"),
])
def test_targets_minivllm_cannot_adapt_are_refused(lora_adapters, tmp_path, targets, match):
    _, adapters = lora_adapters("llama")
    bad = copy_adapter(adapters["qv_r4"], tmp_path / "bad",
                       edit=lambda c: c.update(target_modules=targets))
    with pytest.raises(ValueError, match=match):
        load(bad)


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("kwargs, name", [
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_peft_options_that_change_the_maths_are_refused_by_name(lora_adapters, tmp_path, kwargs,
                                                                 name):
    base, _ = lora_adapters("llama")
    path = save_peft_adapter(base, tmp_path / "a", r=2, target_modules=["q_proj"], **kwargs)
    with pytest.raises(ValueError, match=name):
        load(path)


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["embed_tokens"]])
def test_peft_made_embedding_and_head_adapters_are_refused(lora_adapters, tmp_path, targets):
    base, _ = lora_adapters("llama")
    path = save_peft_adapter(base, tmp_path / "a", r=2, target_modules=targets)
    with pytest.raises(ValueError, match="embedding or the LM head"):
        load(path)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(fan_in_fan_out=True), "fan_in_fan_out"),
    (lambda c: c.update(layer_replication=[[0, 1]]), "layer_replication"),
    (lambda c: c.update(lora_bias=True), "lora_bias"),
    (lambda c: c.update(peft_type="IA3"), "peft_type"),
    (lambda c: c.update(some_future_option={"on": True}), "unknown option some_future_option"),
    (lambda c: c.update(rank_pattern={"q_proj": 3}), "rank 4, but adapter_config.json says r=3"),
    (lambda c: c.update(rank_pattern=[1]), "rank_pattern must be a dict"),
    (lambda c: c.update(r=0), "r must be an int"),
    (lambda c: c.update(target_modules=["q_proj"]), "not targeted"),  # v_proj weights left
    (lambda c: c.update(layers_to_transform=[0]), "not targeted"),  # layer 1 weights left
])
def test_config_edits_are_refused_by_name(lora_adapters, tmp_path, edit, match):
    _, adapters = lora_adapters("llama")
    with pytest.raises(ValueError, match=match):
        load(copy_adapter(adapters["qv_r4"], tmp_path / "bad", edit=edit))


def test_options_that_do_not_change_inference_are_accepted(lora_adapters, tmp_path):
    _, adapters = lora_adapters("llama")
    ok = copy_adapter(adapters["qv_r4"], tmp_path / "ok", edit=lambda c: c.update(
        lora_dropout=0.3, init_lora_weights="gaussian", some_future_option=None,
        inference_mode=True))
    assert load(ok).rank == 4


@pytest.mark.parametrize("tensors, match", [
    (lambda w: w.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
     "not both"),
    (lambda w: w.__setitem__("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                             torch.zeros(64, 5)), "lora_B"),
    (lambda w: w.__setitem__("base_model.model.model.layers.0.mlp.fc1.lora_A.weight",
                             torch.zeros(4, 64)), "unknown target module"),
    (lambda w: w.__setitem__("base_model.model.model.layers.0.self_attn.q_proj"
                             ".lora_magnitude_vector", torch.zeros(64)), "DoRA"),
])
def test_weight_files_that_disagree_are_refused(lora_adapters, tmp_path, tensors, match):
    _, adapters = lora_adapters("llama")
    with pytest.raises(ValueError, match=match):
        load(copy_adapter(adapters["qv_r4"], tmp_path / "bad", tensors=tensors))
