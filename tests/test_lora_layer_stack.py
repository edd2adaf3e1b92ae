"""LoRA on the fast path: a step with adapters stays in the C++ layer stack, bit for bit.

The model's own forward adds each token's adapter delta after every projection
(``ProjectionLoRA``, :mod:`minivllm.lora.layers`; test_lora_engine.py checks it
against PEFT). The C++ layer stack (:mod:`minivllm.fast.model_runner`) must add the
same deltas with the same op at the same points, so the oracle here is the same
engine with ``enforce_eager=True``: equal tokens and equal logprobs, exactly. A stack
that skipped the delta (or one projection's), added it after the wrong projection,
to the wrong output slice, mapped tokens to the wrong slot, or applied an adapter to
the base model's rows would change them. The batch is awkward on purpose: adapters
of rank 1, 3, 4 and 8 (with per-module ranks 2 and 12), on subsets of the
projections and layers, rows of the base model among them, and a small token budget
so that prefill chunks and decodes share steps.
"""

from __future__ import annotations

import lora_utils
import pytest
from lora_utils import lora_request
from test_engine import random_prompts

from minivllm import LLM, SamplingParams
from minivllm.fast import cpu_ops
from minivllm.model.llama import LlamaDecoderLayer

lora_adapters = lora_utils.lora_adapters  # the session fixture (see lora_utils)

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops did not build")

#: Per request: its adapter (None: the base model). Ranks 1 to 16, subsets of projections.
NAMES = ["qv_r4", None, "regex_r1", "layer1_r3", "patterns_r8", None, "mlp_rslora_r8",
         "qv_r4"]


def _generate(llm: LLM, prompts, names, adapters, max_tokens=8):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       logprobs=2),
                        use_tqdm=False,
                        lora_request=[None if n is None else lora_request(adapters, n)
                                      for n in names])
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


def _stack_steps(monkeypatch) -> list[tuple[int, int, bool]]:
    """``(rows, longest query, has adapters)`` of every step the C++ stack runs from now on."""
    from minivllm.fast.model_runner import LayerStack

    steps: list[tuple[int, int, bool]] = []
    run = LayerStack.run

    def spy(self, mi, **kw):
        steps.append((mi.input_ids.shape[0], mi.attn_metadata.max_query_len,
                      mi.lora is not None))
        return run(self, mi, **kw)

    monkeypatch.setattr(LayerStack, "run", spy)
    return steps


def _eager_layers(monkeypatch) -> list[int]:
    """One entry per decoder layer's own forward from now on (the eager path)."""
    calls: list[int] = []
    forward = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward",
                        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    return calls


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("mistral", "float32"),
                                        ("llama_tied", "bfloat16")])
def test_steps_with_adapters_run_in_the_layer_stack_bit_for_bit(lora_adapters, monkeypatch,
                                                                  arch, dtype):
    base, adapters = lora_adapters(arch)
    kw = dict(backend="fast", dtype=dtype, device="cpu", max_model_len=128, block_size=4,
              enable_lora=True, max_loras=4, max_lora_rank=16, max_num_batched_tokens=16,
              max_num_seqs=8)
    prompts = random_prompts(len(NAMES), [3, 11, 6, 2, 9], seed=5)
    eager = LLM(str(base), enforce_eager=True, **kw)
    want = _generate(eager, prompts, NAMES, adapters)
    base_model = _generate(eager, prompts, [None] * len(NAMES), adapters)
    # The adapters change the logprobs of every adapted request, some by a lot (else
    # nothing is tested: the comparison below is exact, so any change counts).
    changes = {i: max(abs(a - b) for a, b in zip(want[1][i], base_model[1][i]))
               for i, name in enumerate(NAMES) if name is not None}
    assert min(changes.values()) > 0 and max(changes.values()) > 1e-2, changes

    fast = LLM(str(base), **kw)
    runner = fast.llm_engine.executor.worker.model_runner
    assert runner.fast_paths == ("cpu_layer_stack",)
    assert "lora" in runner.model.features
    steps, eager_calls = _stack_steps(monkeypatch), _eager_layers(monkeypatch)
    got = _generate(fast, prompts, NAMES, adapters)
    assert got[0] == want[0]
    assert got[1] == want[1]  # bit for bit: the same ops on the same inputs
    assert eager_calls == [], "a step left the C++ layer stack"
    lora_steps = [s for s in steps if s[2]]
    assert any(q > 1 for _, q, _ in lora_steps), "no prefill chunk with adapters in the stack"
    assert any(q == 1 for _, q, _ in lora_steps), "no decode step with adapters in the stack"
    assert any(rows > 1 and q > 1 and rows > q for rows, q, _ in lora_steps), \
        "no step mixing a prefill chunk with other rows"


def test_a_step_without_adapters_in_a_lora_engine_is_the_base_model(lora_adapters, monkeypatch):
    """The same prompts with no adapter: the LoRA engine's stack gives the plain engine's
    tokens and logprobs (slots that hold adapters are not applied to base rows)."""
    base, adapters = lora_adapters("llama")
    kw = dict(backend="fast", dtype="float32", device="cpu", max_model_len=128, block_size=4)
    prompts = random_prompts(4, [5, 8], seed=9)
    plain = _generate(LLM(str(base), **kw), prompts, [None] * 4, adapters)
    lora = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, **kw)
    _generate(lora, prompts, ["all_r16", None, "qv_r4", None], adapters)  # fill the slots
    lora.llm_engine.scheduler.reset_prefix_cache()  # prefill as the plain engine did
    steps = _stack_steps(monkeypatch)
    assert _generate(lora, prompts, [None] * 4, adapters) == plain
    assert steps and not any(has for _, _, has in steps)


def test_a_lora_component_that_is_not_the_cpp_op_runs_the_models_forward(lora_adapters):
    """The stack calls the C++ ``add_lora``; where the engine's ``lora`` component is
    another (the ref, a student's), the model's forward runs so that that one does, and
    an engine without LoRA keeps the stack (it never calls the component)."""
    from minivllm import backend

    base, _ = lora_adapters("llama")
    spec = {**{c: "fast" for c in backend.COMPONENTS}, "lora": "ref"}
    kw = dict(backend=spec, dtype="float32", device="cpu", max_model_len=64)
    runner = LLM(str(base), enable_lora=True, **kw).llm_engine.executor.worker.model_runner
    assert runner.fast_paths == () and "lora" in runner.fallback_reason
    plain = LLM(str(base), **kw).llm_engine.executor.worker.model_runner
    assert plain.fast_paths == ("cpu_layer_stack",)
