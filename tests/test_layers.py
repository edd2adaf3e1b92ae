"""The import graph: no cycles, and no module imports a layer above its own.

Data flows one way through minivllm, and so do imports. The layers, lowest
first (:data:`LAYERS`): the shared types and rules every part reads; the
swap layer and the components' twins; the model; the engine (executors,
workers, the step, speculative decoding's proposers); and the entry points
(``LLM``, the CLI, the server, benchmarks, the course kit, the pytest plugin).
A module may import its own layer and the layers below it, never one above
(a shared type lives low enough for everyone who reads it), and no two
modules may import each other, directly or through others. Imports inside
functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import minivllm

ROOT = Path(minivllm.__file__).parent

#: (layer, module-name prefixes), lowest first. A module belongs to the layer of its
#: longest matching prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("minivllm.config", "minivllm.metadata", "minivllm.request",
              "minivllm.sampling_params", "minivllm.sampling_metadata", "minivllm.prefix_hash",
              "minivllm.dtype", "minivllm.cpu_target", "minivllm.profiler", "minivllm.outputs", "minivllm.distributed",
              "minivllm.tp_shards", "minivllm.pp_stages", "minivllm.quantized_weight",
              "minivllm.hf_config", "minivllm.structured_outputs_params",
              "minivllm.kv_quant",
              "minivllm.spec_decode", "minivllm.spec_decode.config",
              "minivllm.spec_decode.metadata", "minivllm.spec_decode.backoff",
              "minivllm.lora", "minivllm.scheduler_groups", "minivllm.request_queue",
              "minivllm.structured_output", "minivllm.logits_processor",
              "minivllm.step_sampling")),
    ("components", ("minivllm.backend", "minivllm.ref", "minivllm.fast")),
    ("model", ("minivllm.model",)),
    ("engine", ("minivllm.engine", "minivllm.executor", "minivllm.worker",
                "minivllm.spec_decode.proposer",
                "minivllm.spec_decode.draft_model")),
    ("entrypoints", ("minivllm", "minivllm.__main__", "minivllm.llm", "minivllm.cli",
                     "minivllm.entrypoints", "minivllm.bench", "minivllm.course",
                     "minivllm.testing")),
)


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s longest matching prefix."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports (anywhere in the file)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                pre = ".".join(base + ([node.module] if node.module else []))
            else:
                pre = node.module or ""
            # `from pkg import mod` imports the module; `from pkg import name` the package.
            names = [f"{pre}.{a.name}" if f"{pre}.{a.name}" in known else pre for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, deps in graph().items():
        # The package's own __init__ only re-exports: it may name anything below it.
        for dep in deps:
            if layer_of(dep) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} "
                              f"({LAYERS[layer_of(dep)][0]})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    """Tarjan's strongly connected components: any with two or more modules is a cycle."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The detector itself: a planted lazy import of the engine from a component."""
    known = {"minivllm.ref.x": tmp_path / "x.py", "minivllm.engine.y": tmp_path / "y.py"}
    known["minivllm.ref.x"].write_text("def f():\n    from minivllm.engine import y\n")
    known["minivllm.engine.y"].write_text("from minivllm.ref import x\n")
    assert imports("minivllm.ref.x", known["minivllm.ref.x"], known) == {"minivllm.engine.y"}
    assert imports("minivllm.engine.y", known["minivllm.engine.y"], known) == {"minivllm.ref.x"}
    assert layer_of("minivllm.engine.y") > layer_of("minivllm.ref.x")
