"""The course's contracts: what a handout promises is what the engine calls.

Each handout (``docs/course/NN_task.md``) has a **Signatures** section: a Python
block with the signature of every public function the task asks for. This
test holds the solution (the ref, or the fast twin for kernel tasks) to it,
parameter by parameter: names, order, kind (positional or keyword-only) and
defaults. A parameter added to a component's API must be added to the handout
too, keyword-only with a default (as vLLM adds ``num_lookahead_tokens``), and
the engine passes it only when it is used, so a package written from an older
handout keeps working.

The last tests run packages written from the handouts alone (``independent.py``:
no subclass of the ref, no call into it) through the grader, for full marks, and
inside the engine, to this round's signatures and to the last round's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import independent
import pytest

from minivllm.course import grade as grading
from minivllm.course.manifest import TASKS, Task, get_task
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


@pytest.fixture
def ref_only(backend_spec):
    if backend_spec != "ref":
        pytest.skip("grades the course kit, not the backend: runs once, under --backend=ref")


@pytest.mark.parametrize("name", ["kv_cache_manager", "scheduler"])
def test_a_package_written_from_the_handout_alone_gets_full_marks(name, tmp_path, ref_only):
    """``independent.py``'s manager and scheduler, written from the handouts' contract and
    unlike the ref (no subclass, no call into it), keep full marks: the grader asks for
    the contract, not for the ref's internals."""
    package = independent.build(name, tmp_path, f"handout_{name}")
    task = get_task(name)
    report, _ = grading.run_tests(package, [task], pythonpath=[tmp_path])
    [result] = grading.score([task], report)
    assert result.score == result.points, (
        f"{name} written from the handout scored {result.score}/{result.points}: a test asks "
        f"for more than the contract; first failures: {result.failures[:3]}")


def test_a_scheduler_that_fills_in_its_output_is_told_why_at_grade_time(tmp_path, ref_only):
    """The previous handout's scheduler made an empty ``SchedulerOutput`` and filled it in;
    it is frozen now. It cannot score (it raises), but the grader says why, with the line,
    on every test of the task, instead of a traceback per test."""
    package = independent.build("scheduler", tmp_path, "filled_in_output", filled_in=True)
    task = get_task("scheduler")
    report, _ = grading.run_tests(package, [task], pythonpath=[tmp_path])
    [result] = grading.score([task], report)
    assert result.score == 0 and result.failures
    for failure in result.failures:
        message = failure["message"]
        assert "frozen" in message and "05_scheduler.md" in message, message
        assert "scheduler.py:" in message and "output.scheduled_requests" in message, message


@pytest.mark.parametrize("code, writes", [
    ("so = SchedulerOutput()\n    so.scheduled_requests.append(r)", ["so.scheduled_requests"]),
    ("so = SchedulerOutput()\n    so.num_scheduled_tokens[r] = 1", ["so.num_scheduled_tokens"]),
    ("so = Out(finished_req_ids=f)\n    so.total_num_scheduled_tokens += 1",
     ["so.total_num_scheduled_tokens"]),
    ("so = metadata.SchedulerOutput()\n    so.new_block_ids.setdefault(r, []).append(1)",
     ["so.new_block_ids"]),
    ("so = SchedulerOutput(new_req_ids=ids)\n    ids.append(1)\n    n = so.new_req_ids", []),
    ("so = SchedulerOutput()\n    other.scheduled_requests.append(r)", []),
], ids=["append", "item", "augmented", "nested", "reads only", "another object"])
def test_the_contract_check_finds_only_writes_into_an_output(code, writes):
    from minivllm.course.contracts import filled_in_scheduler_outputs

    source = f"from minivllm.metadata import SchedulerOutput as Out\n\ndef f():\n    {code}\n"
    assert [w for _, w in filled_in_scheduler_outputs(source)] == writes


def test_no_scheduler_of_ours_is_refused_by_the_contract_check(tmp_path):
    from minivllm.course.contracts import filled_in_scheduler_outputs
    from minivllm.fast import scheduler as fast_scheduler
    from minivllm.ref import scheduler as ref_scheduler

    package = independent.build("scheduler", tmp_path, "handout_checked")
    sources = [inspect.getsource(ref_scheduler), inspect.getsource(fast_scheduler),
               (tmp_path / package / "scheduler.py").read_text()]
    assert [filled_in_scheduler_outputs(s) for s in sources] == [[], [], []]


@pytest.mark.parametrize("serves, older", [
    ("kv_cache_manager", True), ("scheduler", True), ("both", False), ("both", True)],
    ids=["older kv_cache_manager", "older scheduler", "both", "both older"])
def test_packages_written_from_the_handouts_serve_the_engine(serves, older, tiny_model_dir,
                                                             tmp_path, monkeypatch) -> None:
    """The same packages inside the engine, with a pool small enough to preempt, give the
    ref's tokens. ``older``: written to the last round's handouts (``allocate_slots``
    without ``num_lookahead_tokens``, ``schedule(self)`` without ``in_flight``), which an
    engine without a draft model or a pipeline never passes."""
    # A name per case: a package imported once stays in sys.modules for the session.
    package = independent.build(serves, tmp_path, f"handout_{serves}_{older}".lower(), older=older)
    monkeypatch.syspath_prepend(str(tmp_path))
    from minivllm import LLM

    components = ("kv_cache_manager", "scheduler") if serves == "both" else (serves,)
    path = str(tiny_model_dir("llama"))
    kw = dict(dtype="float32", device="cpu", max_model_len=48, block_size=4,
              num_gpu_blocks_override=12)  # small: allocation and preemption both happen
    expect = _generate(LLM(path, backend="ref", **kw))
    llm = LLM(path, backend=dict.fromkeys(components, package), **kw)
    scheduler = llm.llm_engine.scheduler
    served = {"scheduler": type(scheduler), "kv_cache_manager": type(scheduler.kv_cache_manager)}
    for name in components:
        assert served[name].__module__ == f"{package}.{name}", f"{name} is not the package's"
    assert _generate(llm) == expect


# ------------------------------------------------------------------ what the engine calls

ROOT = DOCS.parents[1]


def _contract_section(task_name: str) -> str:
    page = (DOCS / handout_name(get_task(task_name))).read_text()
    section = re.search(r"## What the [\w ]+ calls: the contract\n(.*?)\n## ", page, re.S)
    assert section, f"{handout_name(get_task(task_name))} has no 'What the ... calls' section"
    return section.group(1)


def _attributes_read_on(name: str, files: list[Path]) -> set[str]:
    """Every ``<...>.<name>.X`` or ``<name>.X`` in ``files`` (parsed): what the code calls."""
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                base = node.value
                base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if base_name == name and not node.attr[0].isupper():  # not the class itself
                    found.add(node.attr)
    return found


def _unnamed(names: set[str], section: str) -> list[str]:
    return sorted(n for n in names if not re.search(rf"\b{n}\b", section))


def test_the_scheduler_handout_names_everything_the_engine_calls() -> None:
    engine = sorted((ROOT / "minivllm" / "engine").glob("*.py")) + [ROOT / "minivllm" / "llm.py"]
    called = _attributes_read_on("scheduler", engine)
    assert {"schedule", "update_from_output", "add_request"} <= called  # the scan works
    missing = _unnamed(called, _contract_section("scheduler"))
    assert not missing, f"the engine calls scheduler.{missing}; 05_scheduler.md's contract " \
                        "does not say so"


def test_the_kv_cache_manager_handout_names_everything_the_scheduler_calls() -> None:
    scheduler = [ROOT / "minivllm" / "ref" / "scheduler.py", ROOT / "minivllm" / "scheduler_groups.py"]
    called = _attributes_read_on("kv_cache_manager", scheduler)
    assert {"allocate_slots", "free"} <= called
    missing = _unnamed(called, _contract_section("kv_cache_manager"))
    assert not missing, f"the scheduler calls kv_cache_manager.{missing}; " \
                        "04_kv_cache_manager.md's contract does not say so"


def test_the_allocator_handout_names_everything_its_callers_use() -> None:
    callers = [ROOT / "minivllm" / "ref" / f"{m}.py" for m in ("kv_cache_manager", "scheduler")]
    callers += [ROOT / "minivllm" / "fast" / "kv_cache_manager.py",
                ROOT / "minivllm" / "scheduler_groups.py"]
    called = _attributes_read_on("block_allocator", callers) | _attributes_read_on(
        "allocator", callers)
    assert {"allocate", "free", "touch", "lookup_cached_blocks"} <= called
    missing = _unnamed(called, _contract_section("allocator"))
    assert not missing, f"the KV cache manager or scheduler uses block_allocator.{missing}; " \
                        "01_allocator.md's contract does not say so"


def test_the_scheduler_handout_builds_the_output_with_every_field() -> None:
    """The handout's ``SchedulerOutput(...)`` call takes exactly the fields the (frozen)
    dataclass's constructor takes: a field added to the output is added to the handout."""
    import dataclasses

    from minivllm.metadata import SchedulerOutput

    block = re.search(r"```python\n(.*?SchedulerOutput\(.*?)```", _contract_section("scheduler"),
                      re.S)
    assert block, "05_scheduler.md's contract must show how a SchedulerOutput is built"
    call = next(n for n in ast.walk(ast.parse(textwrap.dedent(block.group(1))))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "SchedulerOutput")
    shown = [k.arg for k in call.keywords]
    fields = [f.name for f in dataclasses.fields(SchedulerOutput) if f.init]
    assert shown == fields, f"the handout builds SchedulerOutput({shown}); it takes {fields}"
    assert SchedulerOutput.__dataclass_params__.frozen, \
        "SchedulerOutput is no longer frozen: the handout's contract says it is"
