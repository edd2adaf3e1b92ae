"""The course kit itself: manifest, markers, generated stubs, grader, no silent fallback.

The end-to-end checks (grading the generated stubs and the solution, the
mutation self-check) run real pytest subprocesses; they run once, under
``--backend=ref`` (they do not depend on the backend under test).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from minivllm import backend
from minivllm.course import grade as grading
from minivllm.course import mutants, student
from minivllm.course.manifest import TASKS, get_task, nodeid_matches, tasks_for_nodeid

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ref_only(backend_spec):
    if backend_spec != "ref":
        pytest.skip("checks the course kit, not the backend: runs once, under --backend=ref")


# ------------------------------------------------------------------------- the manifest


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_every_task_has_its_marker_regions(task):
    assert student.check_task_regions(task) == []


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_every_selector_names_an_existing_test(task):
    for pattern in task.tests:
        path, _, name = pattern.partition("::")
        assert (REPO / path).exists(), f"task {task.name}: {path} does not exist"
        if name:
            tree = ast.parse((REPO / path).read_text())
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                        if isinstance(t, ast.Name)}  # TestMachine = Machine.TestCase
            assert name.split("::")[0] in defined, f"task {task.name}: no {name} in {path}"
    for path in task.reading:
        assert (REPO / path).exists(), f"task {task.name}: reading {path} does not exist"


def test_names_numbers_and_lookup():
    assert [t.number for t in TASKS] == list(range(1, len(TASKS) + 1))
    assert len({t.name for t in TASKS}) == len(TASKS)
    assert get_task("rms_norm").component == "layernorm"
    with pytest.raises(ValueError, match="unknown task 'rmsnorm'.*rms_norm"):
        get_task("rmsnorm")
    assert nodeid_matches("tests/a.py::test_b[3]", "tests/a.py::test_b")
    assert not nodeid_matches("tests/a.py::test_b_c", "tests/a.py::test_b")
    assert [t.name for t in tasks_for_nodeid("tests/test_small_kernels.py::test_rms_norm")] == [
        "rms_norm"]


# ------------------------------------------------------------------------- markers and stubs


def test_malformed_markers_are_errors_naming_the_file(tmp_path):
    body = "def f(x):\n    # BEGIN SOLUTION\n    return x\n"
    with pytest.raises(ValueError, match=r"bad\.py:2: # BEGIN SOLUTION is never closed"):
        student.find_regions(body, "bad.py")
    with pytest.raises(ValueError, match=r"bad\.py:1: # END SOLUTION without"):
        student.find_regions("# END SOLUTION\n", "bad.py")
    with pytest.raises(ValueError, match="layernorm.py has no # BEGIN SOLUTION"):
        student.stub_file("def rms_norm(x, w, eps):\n    return x\n", "layernorm.py", "pkg")


def _api(text: str) -> dict[str, tuple[str, str | None]]:
    """Every function's signature and docstring, by qualified name."""
    out = {}
    for first, _, name in student._functions_by_line(ast.parse(text)):
        node = next(n for n in ast.walk(ast.parse(text))
                    if isinstance(n, ast.FunctionDef) and n.lineno == first)
        out[name] = (ast.unparse(node.args), ast.get_docstring(node))
    return out


def test_stubs_keep_every_signature_and_docstring(tmp_path):
    pkg = student.make_student(tmp_path, "stubs")
    for ref in sorted((REPO / "minivllm" / "ref").glob("*.py")):
        if ref.stem == "__init__":
            continue
        stub = (pkg / ref.name).read_text()
        assert _api(stub) == _api(ref.read_text()), f"{ref.name}: the stubs' API differs"
        assert "BEGIN SOLUTION" not in stub and "minivllm.ref" not in stub
    text = (pkg / "layernorm.py").read_text()
    assert 'raise NotImplementedError("Task 6 (rms_norm): write rms_norm' in text
    assert "# (num_tokens, hidden)" in text  # shape comments in the signature stay
    rewritten = student._rewrite_imports(
        "from minivllm.ref.kv_cache_manager import KVCacheManager\n"
        "from minivllm.ref import sampler\nfrom minivllm.refs import x\n", "ref", "stubs")
    assert rewritten == ("from stubs.kv_cache_manager import KVCacheManager\n"
                         "from stubs import sampler\nfrom minivllm.refs import x\n")
    with pytest.raises(ValueError, match="already exists"):
        student.make_student(tmp_path, "stubs")


def test_generated_packages_build_cpp_under_the_lock_and_pass_the_scan(tmp_path):
    """The C++ task's module, stubbed or solved, builds through minivllm's build lock
    (``minivllm.fast.cpp_build``), and the import scan lets that helper through."""
    for name, solution in (("stubs", False), ("solved", True)):
        pkg = student.make_student(tmp_path, name, solution=solution)
        text = (pkg / "activation_cpp.py").read_text()
        assert "from minivllm.fast.cpp_build import load_inline" in text
        assert "torch.utils.cpp_extension import" not in text  # not torch's bare lock
        assert grading.scan_package(pkg) == [], name


# ------------------------------------------------------------------------- the swap layer


def test_describe_names_any_provider(tmp_path, monkeypatch):
    pkg = tmp_path / "attr_provider"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import types
        from minivllm.ref.activation import silu_and_mul
        activation = types.SimpleNamespace(silu_and_mul=silu_and_mul)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    served = backend.describe("attr_provider")
    assert served["activation"] == "<types.SimpleNamespace object>"
    assert served["layernorm"] == "minivllm.ref.layernorm"
    assert backend.provides("attr_provider", "activation")
    assert not backend.provides("attr_provider", "layernorm")


def _write_partial_package(root: Path) -> None:
    pkg = root / "partial_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "activation.py").write_text(textwrap.dedent("""
        import torch.nn.functional as F

        def silu_and_mul(x):
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
    """))
    # Every class and method tp_linear names, but not the SIMULATES_ALL_RANKS constant.
    classes: dict[str, list[str]] = {}
    for f in get_task("tp_linear").functions:
        cls, _, method = f.partition(".")
        classes.setdefault(cls, []).append(method)
    (pkg / "linear.py").write_text("".join(
        f"class {c}:\n" + "".join(f"    def {m}(self): ...\n" for m in ms)
        for c, ms in classes.items()))


def test_missing_component_or_attribute_fails_the_task_naming_it(tmp_path, ref_only):
    _write_partial_package(tmp_path)
    tasks = [get_task("rms_norm"), get_task("silu_and_mul"), get_task("tp_linear")]
    report, _ = grading.run_tests("partial_pkg", tasks, pythonpath=[tmp_path])
    results = {r.name: r for r in grading.score(tasks, report)}
    assert results["silu_and_mul"].score == results["silu_and_mul"].points
    rms = results["rms_norm"]
    assert rms.score == 0 and rms.passed == 0
    assert "does not provide the 'layernorm' component" in rms.failures[0]["message"]
    tp = results["tp_linear"]
    assert tp.score == 0 and "SIMULATES_ALL_RANKS" in tp.failures[0]["message"]


def test_header_says_which_module_serves_each_component(tmp_path, ref_only):
    _write_partial_package(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-p", "no:cacheprovider", "--backend=partial_pkg",
         "--task=silu_and_mul", f"--rootdir={REPO}", "tests/test_small_kernels.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert "activation       partial_pkg.activation" in out.stdout, out.stdout[-2000:]
    assert "layernorm        minivllm.ref.layernorm   (not in partial_pkg: the ref twin)" in (
        out.stdout)


# ------------------------------------------------------------------------- grading end to end


def test_stubs_score_zero_on_every_task_and_the_solution_full_marks(tmp_path, ref_only):
    """Every task fails on the generated stubs and passes on the solution."""
    student.make_student(tmp_path, "kit_stubs")
    student.make_student(tmp_path, "kit_solution", solution=True)
    json_path, junit_path = tmp_path / "g.json", tmp_path / "g.xml"
    results, table = grading.grade("kit_stubs", pythonpath=[tmp_path], json_path=str(json_path),
                                   junit_path=str(junit_path))
    assert table.splitlines()[-1] == f"score: 0/{sum(t.points for t in TASKS)}"
    for r in results:
        assert r.score == 0 and r.failed > 0, f"task {r.name}: a stub passed every test"
        assert "Task " in r.failures[0]["message"], r.failures[0]  # a stub's message
    data = json.loads(json_path.read_text())
    assert data["score"] == 0 and len(data["tasks"]) == len(TASKS)
    suites = ET.parse(junit_path).getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [f"task_{t.name}" for t in TASKS]

    results, table = grading.grade("kit_solution", pythonpath=[tmp_path])
    full = sum(t.points for t in TASKS)
    assert table.splitlines()[-1] == f"score: {full}/{full}", table
    for r in results:
        assert r.tests > 0 and r.failed == 0


def test_cli_grade_exit_status_and_submit(tmp_path, ref_only, monkeypatch):
    from minivllm.cli import main

    student.make_student(tmp_path, "kit_cli")
    assert main(["course", "grade", "--backend", "kit_cli", "--task", "silu_and_mul",
                 "--path", str(tmp_path)]) == 1
    assert main(["course", "grade", "--backend", "kit_cli", "--task", "no_such_task"]) == 2
    out = tmp_path / "hand_in.zip"
    assert main(["course", "submit", str(tmp_path / "kit_cli"), "-o", str(out)]) == 0
    names = zipfile.ZipFile(out).namelist()
    assert "kit_cli/__init__.py" in names and "kit_cli/layernorm.py" in names


# ------------------------------------------------------------------------- the self-check


def test_every_mutant_applies_to_the_current_ref(tmp_path):
    for mutant in mutants.MUTANTS:
        mutants.build(mutant, tmp_path)
    assert {m.task for m in mutants.MUTANTS} == {t.name for t in TASKS}, "a task has no mutant"


def test_selfcheck_catches_every_mutant(ref_only):
    results = mutants.selfcheck(jobs=2, log=lambda line: None)
    survived = [f"{r.mutant.name} ({r.mutant.task})" for r in results if not r.caught]
    assert not survived, f"mutants that pass their task's tests: {survived}"


def test_host_leaderboard_times_a_package(tmp_path, monkeypatch):
    from minivllm.bench import host

    student.make_student(tmp_path, "kit_board", solution=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (row,) = [r for r in host.run((8,), 0.1, "kit_board") if r["component"] == "scheduler"]
    assert row["package_ms"] > 0 and row["package_speedup"] > 0


def test_extra_tests_join_their_task(tmp_path, ref_only):
    """Hidden tests: a file named like the kit's own (no "import file mismatch"), or a
    marker; a failing one lowers the score; a collection error is a failure too."""
    student.make_student(tmp_path, "kit_extra", solution=True)
    private = tmp_path / "private"
    private.mkdir()
    (private / "helper.py").write_text("LIMIT = 3\n")
    # The same name as tests/course/test_task_silu_and_mul.py.
    (private / "test_task_silu_and_mul.py").write_text(textwrap.dedent("""
        from helper import LIMIT

        def test_by_file_name():
            assert LIMIT == 3
    """))
    (private / "test_hidden.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.task_silu_and_mul
        def test_by_marker():
            assert False, "the instructor's hidden check"

        def test_of_no_task():
            assert False, "not graded"
    """))
    (private / "test_task_rms_norm.py").write_text("import no_such_module\n")
    results, table = grading.grade("kit_extra", ["silu_and_mul", "rms_norm", "rope"],
                                   extra_tests=[str(private)], pythonpath=[tmp_path])
    rms, rope, silu = results  # in task order
    assert silu.score == 0 and silu.failed == 1 and silu.passed == silu.tests - 1, table
    assert silu.passed == 3, "the kit's two tests and the hidden test_by_file_name ran"
    assert "the instructor's hidden check" in silu.failures[0]["message"]
    assert "not graded" not in table
    assert rms.score == 0 and "collection error" in rms.failures[0]["message"], table
    assert rope.score == rope.points, "a hidden file of another task costs this one nothing"
    # Without the hidden tests the same package has full marks: the hidden ones lowered it.
    results, _ = grading.grade("kit_extra", ["silu_and_mul", "rms_norm"], pythonpath=[tmp_path])
    assert all(r.score == r.points for r in results)


def test_gradescope_results_and_partial_credit(tmp_path, ref_only):
    student.make_student(tmp_path, "kit_gs", solution=True)
    sched = tmp_path / "kit_gs" / "scheduler.py"  # a preemption bug: the scheduler loses points
    source = sched.read_text()
    right = "victim = next(r for r in reversed(self.running)"  # the newest request goes
    assert right in source, "the planted bug must change the student's scheduler"
    sched.write_text(source.replace(right, "victim = next(r for r in self.running"))
    out = tmp_path / "results.json"
    results, table = grading.grade("kit_gs", ["silu_and_mul", "scheduler"],
                                   pythonpath=[tmp_path], gradescope_path=str(out))
    data = json.loads(out.read_text())
    names = [t["name"] for t in data["tests"]]
    assert names == ["Task 5 (scheduler): rules",
                     "Task 5 (scheduler): same decisions as the ref", "Task 9 (silu_and_mul)"], names
    for t in data["tests"]:
        assert {"name", "score", "max_score", "output", "visibility"} <= set(t)
    assert data["score"] == sum(t["score"] for t in data["tests"]) == sum(
        r.score for r in results)
    sched_result = results[0]  # in task order
    assert [g["points"] for g in sched_result.groups] == [7, 8]
    assert sched_result.score == sum(g["score"] for g in sched_result.groups) < 15, table


def test_grade_from_another_folder_with_relative_paths(tmp_path, ref_only):
    """PYTHONPATH=hw minivllm course grade ... works outside the checkout; pytest --task from
    there says where the tests are."""
    student.make_student(tmp_path / "hw", "kit_cwd", solution=True)
    env = {**os.environ, "PYTHONPATH": f"hw{os.pathsep}{REPO}", "CI": "true"}
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from minivllm.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "course", "grade", "--backend", "kit_cwd",
         "--task", "silu_and_mul", "--gradescope", "gs.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "score: 2/2"
    assert json.loads((tmp_path / "gs.json").read_text())["score"] == 2
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--backend=kit_cwd",
         "--task=silu_and_mul"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300)
    assert f"The course tests live in {REPO / 'tests'}" in run.stdout, run.stdout[-2000:]
