"""Multi-LoRA serving end to end: ``python -m minivllm.bench lora --e2e``.

B requests (1 or 64), each a short prompt and ``--output-len`` greedy tokens,
through ``LLM.generate`` on SmolLM2: the base model alone (an engine without
LoRA: its fastest path), and the same batch on an ``enable_lora=True,
max_loras=8`` engine with every request on one adapter, and spread
round-robin over 4 and 8 adapters (rank 16, all seven linear modules; made
here in PEFT's format with random weights), the two engines alternated in
``--repeats`` rounds. Each row is generated tokens per second (median, spread)
and its ratio to the base model's. The last line checks the targets of
issue 34 (item 5): at B=1 the adapter costs at most 20% of the base model's
throughput (ratio >= 0.8x), and B=64 over 8 adapters keeps at least 0.8x. The header
names the CPU, its kernel flags and the load average (before and after), since a
shared machine moves these figures.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minivllm.lora.models import PACKED_MODULES_MAPPING, module_shapes

MODULES = tuple(m for modules in PACKED_MODULES_MAPPING.values() for m in modules)


def write_random_adapter(path: Path, hf_config, rank: int, seed: int) -> Path:
    """A PEFT-format adapter on every linear module of every layer, random A and B."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(hf_config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in MODULES:
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            n_in, n_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES,
        "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    return path


def _time(llm, prompts, params, loras) -> float:
    """Generated tokens per second of one ``generate`` call."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def run(model: str = "smollm2", batch_sizes=(1, 64), adapter_counts=(1, 4, 8),
        rank: int = 16, output_len: int = 32, backend: str = "auto",
        dtype: str = "auto", repeats: int = 3) -> list[dict]:
    """Every row (see the module docstring); prints the table.

    Both engines stay up, and each batch size is measured ``repeats`` times in rounds:
    every round times the base model and each adapter count once, starting from the
    other end each round, so a load that comes and goes hits both sides alike. A row
    is the median tokens per second, its spread ((max - min) / median), and the
    median of its per-round ratios to the base model's run of the same round.
    """
    from minivllm import LLM, SamplingParams
    from minivllm.bench._harness import describe_machine
    from minivllm.bench._harness import machine as machine_info
    from minivllm.lora.request import LoRARequest

    machine = machine_info()  # the CPU, its flags, the load before
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    kw = dict(backend=backend, dtype=dtype, max_model_len=256)
    base = LLM(model, **kw)
    hf_config = base.llm_engine.executor.hf_config
    rows = []
    with tempfile.TemporaryDirectory(prefix="minivllm-lora-bench-") as tmp:
        loras = [LoRARequest(f"adapter{i}", i + 1,
                             str(write_random_adapter(Path(tmp) / f"a{i}", hf_config, rank, i)))
                 for i in range(max(adapter_counts))]
        llm = LLM(model, enable_lora=True, max_loras=max(adapter_counts), max_lora_rank=rank,
                  max_cpu_loras=max(adapter_counts), **kw)
        for b in batch_sizes:
            prompts = [f"Request {i}: write a short line about the number {i}."
                       for i in range(b)]
            # adapters -> (engine, each request's adapter); 0: the base model. One request
            # uses one adapter, so a batch has at most b of them.
            cases = {0: (base, None)} | {k: (llm, [loras[i % k] for i in range(b)])
                                         for k in adapter_counts if k <= b}
            for engine, chosen in cases.values():  # warm: adapters loaded, paths built
                engine.generate(prompts[:2], params, use_tqdm=False,
                                lora_request=None if chosen is None else chosen[:2])
            tps: dict[int, list[float]] = {k: [] for k in cases}
            for r in range(repeats):
                for k in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                    engine, chosen = cases[k]
                    tps[k].append(_time(engine, prompts, params, chosen))
            for k, values in tps.items():
                mid = statistics.median(values)
                rows.append(dict(batch=b, adapters=k, tokens_per_s=mid,
                                 spread=(max(values) - min(values)) / mid,
                                 ratio=statistics.median(v / w for v, w in
                                                         zip(values, tps[0]))))
        llm.shutdown()
    base.shutdown()
    rows.sort(key=lambda r: (r["adapters"] > 0, r["batch"], r["adapters"]))
    print(f"\nend to end: {model}, rank {rank}, {output_len} generated tokens per request, "
          f"median of {repeats} alternated rounds; {describe_machine(machine)} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"{'B':>4} {'adapters':>9} {'tok/s':>9} {'spread':>7} {'vs base':>8}")
    for r in rows:
        name = "base" if r["adapters"] == 0 else str(r["adapters"])
        print(f"{r['batch']:>4} {name:>9} {r['tokens_per_s']:>9.1f} {100 * r['spread']:>6.0f}% "
              f"{r['ratio']:>7.2f}x")
    ratio = {(r["batch"], r["adapters"]): r["ratio"] for r in rows}
    if (1, 1) in ratio and (64, 8) in ratio:
        b1, b64 = ratio[(1, 1)], ratio[(64, 8)]
        print(f"targets: B=1 overhead {100 * (1 - b1):.0f}% (<= 20%: "
              f"{'met' if b1 >= 0.8 else 'missed'}), B=64 x 8 adapters {b64:.2f}x "
              f"(>= 0.8x: {'met' if b64 >= 0.8 else 'missed'})")
    return rows


__all__ = ["run", "write_random_adapter"]
