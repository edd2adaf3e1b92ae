"""The adapter manager: slots, the LRU caches, the step's token -> slot map, slot contents.

A hypothesis state machine drives one :class:`LoRAManager` with random steps
(mixed adapters and base-model requests, sometimes more distinct adapters than
slots), explicit loads and removals, on real PEFT adapters. After every rule it
checks the manager against properties, not against a copy of its algorithm:

- every adapter a step needs is resident, and each token's slot is its adapter's;
- a resident adapter keeps its slot; slots are distinct; at most ``max_loras``
  resident, at most ``max_cpu_loras`` loaded, and resident implies loaded;
- an adapter pushed out of its slot was needed by no step since, and was the least
  recently used of those that could go;
- each resident slot holds exactly its adapter (A, B^T zero-padded, the scaling),
  read independently with :func:`~minivllm.lora.peft_format.load_adapter`, and a
  slice the adapter leaves alone has scaling 0.
"""

from __future__ import annotations

import lora_utils
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from lora_utils import ADAPTERS, lora_request

from minivllm.lora.manager import LoRABatch, LoRAConfig, LoRAManager
from minivllm.lora.models import PACKED_MODULES_MAPPING
from minivllm.lora.peft_format import load_adapter
from minivllm.lora.request import LoRARequest
from minivllm.testing.strategies import stateful_settings

lora_adapters = lora_utils.lora_adapters  # the session fixture (tests/lora_utils.py)

NAMES = list(ADAPTERS)


def hf_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


class ManagerMachine(RuleBasedStateMachine):
    """Set ``adapters`` and ``hf_config`` on the class before running it."""

    adapters: dict = {}
    hf_config = None

    @initialize(max_loras=st.integers(1, 3), extra_cpu=st.integers(0, 2))
    def build(self, max_loras, extra_cpu):
        self.config = LoRAConfig(max_loras=max_loras, max_lora_rank=16,
                                 max_cpu_loras=max_loras + extra_cpu)
        self.manager = LoRAManager(self.hf_config, self.config)
        self.clock = 0
        self.last_used: dict[int, int] = {}  # id -> the step that last needed it
        self.truth = {n: load_adapter(lora_request(self.adapters, n), self.hf_config, 16)
                      for n in NAMES}

    def _id(self, name: str) -> int:
        return lora_request(self.adapters, name).lora_int_id

    @rule(names=st.lists(st.sampled_from([*NAMES, None]), min_size=1, max_size=6),
          data=st.data())
    def step(self, names, data):
        counts = data.draw(st.lists(st.integers(1, 3), min_size=len(names), max_size=len(names)))
        requests = [None if n is None else lora_request(self.adapters, n) for n in names]
        needed = {r.lora_int_id for r in requests if r is not None}
        before = self.manager.resident()
        if len(needed) > self.config.max_loras:
            with pytest.raises(ValueError, match="max_loras"):
                self.manager.prepare_step(requests, counts)
            assert self.manager.resident() == before, "a refused step changed the slots"
            return
        self.clock += 1
        batch = self.manager.prepare_step(requests, counts)
        after = self.manager.resident()
        assert needed <= set(after), "a needed adapter is not resident"
        expected = [-1 if r is None else after[r.lora_int_id] for r, c in zip(requests, counts)
                    for _ in range(c)]
        assert batch.mapping.token_slots.tolist() == expected
        for lora_id, slot in before.items():
            if lora_id in after:
                assert after[lora_id] == slot, "a resident adapter moved slot"
            elif lora_id in self.manager.list_loras():  # pushed out of its slot, still loaded
                assert lora_id not in needed
                survivors = [i for i in after if i in before and i not in needed]
                assert all(self.last_used[lora_id] <= self.last_used[i] for i in survivors), \
                    "evicted a slot that was not the least recently used"
        for lora_id in needed:
            self.last_used[lora_id] = self.clock
        self.check_contents(batch)

    @rule(name=st.sampled_from(NAMES))
    def load(self, name):
        self.manager.add_lora(lora_request(self.adapters, name))
        assert self._id(name) in self.manager.list_loras()

    @rule(name=st.sampled_from(NAMES))
    def remove(self, name):
        was = self._id(name) in self.manager.list_loras()
        assert self.manager.remove_lora(self._id(name)) == was
        assert self._id(name) not in self.manager.resident()
        assert self._id(name) not in self.manager.list_loras()

    @invariant()
    def bounded_and_consistent(self):
        if not hasattr(self, "manager"):
            return
        resident, loaded = self.manager.resident(), self.manager.list_loras()
        assert len(resident) <= self.config.max_loras
        assert len(loaded) <= self.config.max_cpu_loras
        assert set(resident) <= set(loaded), "resident but not loaded"
        assert len(set(resident.values())) == len(resident), "two adapters share a slot"

    def check_contents(self, batch: LoRABatch):
        by_id = {self._id(n): n for n in NAMES}
        for lora_id, slot in self.manager.resident().items():
            truth = self.truth[by_id[lora_id]]
            for layer in range(self.hf_config.num_hidden_layers):
                for projection in PACKED_MODULES_MAPPING:
                    stack = batch.stack(layer, projection)
                    for i, module in enumerate(stack.modules):
                        a, b = stack.lora_a[i][slot], stack.lora_b[i][slot]
                        scale = stack.scalings[i][slot].item()
                        w = truth.get(layer, module)
                        if w is None:
                            assert scale == 0, f"{module} is not adapted but has a scaling"
                            continue
                        assert scale == pytest.approx(w.scaling)
                        assert torch.equal(a[: w.rank], w.lora_a) and not a[w.rank :].any()
                        assert torch.equal(b[: w.rank], w.lora_b.T) and not b[w.rank :].any()


def test_manager_state_machine(lora_adapters):
    base, adapters = lora_adapters("llama")
    ManagerMachine.adapters, ManagerMachine.hf_config = adapters, hf_config(base)
    ManagerMachine.TestCase.settings = stateful_settings(max_examples=30, step_count=12)
    ManagerMachine.TestCase().runTest()


def test_same_id_with_another_adapter_is_refused(lora_adapters):
    base, adapters = lora_adapters("llama")
    manager = LoRAManager(hf_config(base), LoRAConfig(max_loras=2))
    manager.add_lora(LoRARequest("a", 5, str(adapters["qv_r4"])))
    with pytest.raises(ValueError, match="lora_int_id 5 is already loaded"):
        manager.add_lora(LoRARequest("b", 5, str(adapters["regex_r1"])))


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=3, max_cpu_loras=2), "max_cpu_loras"), (dict(max_loras=True), "max_loras"),
])
def test_lora_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRAConfig(**kwargs)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


def test_slot_eviction_is_least_recently_used_not_first_loaded(lora_adapters):
    """Steps [A], [B], [A], [C] with two slots: C takes B's slot (B was used longest ago),
    although A was loaded first; then [B] takes A's, which [C] did not touch."""
    base, adapters = lora_adapters("llama")
    manager = LoRAManager(hf_config(base), LoRAConfig(max_loras=2, max_cpu_loras=4))
    a, b, c = (lora_request(adapters, n) for n in ("qv_r4", "all_r16", "regex_r1"))
    for req in (a, b, a):
        manager.prepare_step([req], [1])
    slots = manager.resident()
    manager.prepare_step([c, None], [2, 1])
    assert manager.resident() == {a.lora_int_id: slots[a.lora_int_id],
                                  c.lora_int_id: slots[b.lora_int_id]}
    manager.prepare_step([None, b], [1, 1])
    assert manager.resident()[b.lora_int_id] == slots[a.lora_int_id]
    assert b.lora_int_id in manager.list_loras() and len(manager.list_loras()) == 3
