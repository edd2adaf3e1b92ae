"""The course's contracts: what a handout promises is what the engine calls.

Each handout (``docs/course/NN_task.md``) has a **Signatures** section: a Python
block with the signature of every public function the task asks for. This
test holds the solution (the ref, or the fast twin for kernel tasks) to it,
parameter by parameter: names, order, kind (positional or keyword-only) and
defaults. A parameter added to a component's API must be added to the handout
too, keyword-only with a default (as vLLM adds ``num_lookahead_tokens``), and
the engine passes it only when it is used, so a package written from an older
handout keeps working: the last two tests run such packages inside the engine.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from minivllm.course.manifest import TASKS, Task
from minivllm.course.student import handout_name

DOCS = Path(__file__).resolve().parents[2] / "docs" / "course"


def handout_signatures(task: Task) -> dict[str, ast.FunctionDef]:
    """``{"Class.method" or "function": its def}`` from the handout's Signatures block."""
    page = (DOCS / handout_name(task)).read_text()
    section = re.search(r"## Signatures\n(.*?)(?:\n## |\Z)", page, re.S)
    assert section, f"{handout_name(task)} has no '## Signatures' section"
    block = re.search(r"```python\n(.*?)```", section.group(1), re.S)
    assert block, f"{handout_name(task)}: the Signatures section needs a python block"
    found = {}
    for node in ast.parse(block.group(1)).body:
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef):
                    found[f"{node.name}.{fn.name}"] = fn
        elif isinstance(node, ast.FunctionDef):
            found[node.name] = node
    return found


def _params(fn: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` per parameter, in order (``default`` is ``...`` if none)."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [...] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) if not isinstance(d, ast.Call) else ast.unparse(d)
        for d in args.defaults]
    out = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    out += [(a.arg, "keyword-only", ... if d is None else
             (ast.literal_eval(d) if not isinstance(d, ast.Call) else ast.unparse(d)))
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return out


def _code_params(obj) -> list[tuple[str, str, object]]:
    out = []
    for p in inspect.signature(obj).parameters.values():
        kind = "keyword-only" if p.kind is p.KEYWORD_ONLY else "positional"
        default = ... if p.default is p.empty else p.default
        if isinstance(default, frozenset) and not default:
            default = "frozenset()"
        out.append((p.name, kind, default))
    return out


def _solution(task: Task, name: str):
    package = "minivllm.ref" if task.source == "ref" else "minivllm.fast"
    obj = importlib.import_module(f"{package}.{task.module}")
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_the_solution_keeps_the_handouts_signatures(task: Task) -> None:
    public = [f for f in task.functions if not any(p.startswith("_") for p in f.split("."))]
    if not public:  # a kernel task: the student writes a private kernel the launcher calls
        assert "## Signatures" not in (DOCS / handout_name(task)).read_text()
        return
    promised = handout_signatures(task)
    assert sorted(promised) == sorted(public), (
        f"{handout_name(task)}: its Signatures block must list exactly the task's public "
        f"functions {public}")
    for name, fn in promised.items():
        assert _code_params(_solution(task, name)) == _params(fn), (
            f"{task.module}.{name} no longer has the signature {handout_name(task)} promises: "
            "a new parameter is keyword-only with a default, and both change together")


def test_the_checker_tells_positional_from_keyword_only() -> None:
    """The mistake the issue found: a new parameter added as a positional one."""
    promised = ast.parse("def f(self, a, b=(), *, n=0): ...").body[0]

    def positional(self, a, b=(), n=0): ...

    def keyword_only(self, a, b=(), *, n=0): ...

    assert _code_params(keyword_only) == _params(promised)
    assert _code_params(positional) != _params(promised)


def _generate(llm, n: int = 3) -> list[list[int]]:
    from minivllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": [1 + i, 2, 3, 4, 5]} for i in range(n)],
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_kv_cache_manager_from_an_older_handout_serves_the_engine(tiny_model_dir, tmp_path,
                                                                    monkeypatch) -> None:
    """``allocate_slots`` written without ``num_lookahead_tokens`` (the last round's
    handout): the engine without a draft model never passes it."""
    pkg = tmp_path / "older_kv_manager"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kv_cache_manager.py").write_text(
        "from minivllm.ref import kv_cache_manager as _ref\n\n\n"
        "class KVCacheManager(_ref.KVCacheManager):\n"
        "    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=()):\n"
        "        return super().allocate_slots(request, num_new_tokens, new_computed_blocks)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from minivllm import LLM

    path = str(tiny_model_dir("llama"))
    kw = dict(dtype="float32", device="cpu", max_model_len=48, block_size=4,
              num_gpu_blocks_override=12)  # small: allocation and preemption both happen
    expect = _generate(LLM(path, backend="ref", **kw))
    assert _generate(LLM(path, backend={"kv_cache_manager": "older_kv_manager"}, **kw)) == expect


def test_a_scheduler_from_an_older_handout_serves_the_engine(tiny_model_dir, tmp_path,
                                                             monkeypatch) -> None:
    """``schedule(self)`` without ``in_flight``: an engine without a pipeline never passes it."""
    pkg = tmp_path / "older_scheduler"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scheduler.py").write_text(
        "from minivllm.ref import scheduler as _ref\n\n\n"
        "class Scheduler(_ref.Scheduler):\n"
        "    def schedule(self):\n"
        "        return super().schedule()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from minivllm import LLM

    path = str(tiny_model_dir("llama"))
    kw = dict(dtype="float32", device="cpu", max_model_len=64, block_size=4)
    expect = _generate(LLM(path, backend="ref", **kw))
    assert _generate(LLM(path, backend={"scheduler": "older_scheduler"}, **kw)) == expect
