"""Generate a student package from the solution: ``minivllm course make-student DIR``.

The solution is the ref itself (``minivllm/ref``; ``minivllm/fast`` for kernel
tasks). Inside the functions a task asks for, the body sits between two
comment lines::

    def rms_norm(x, weight, eps):  # (num_tokens, hidden) ...
        \"\"\"RMS-normalise each row of ``x`` and scale by ``weight``.\"\"\"
        # BEGIN SOLUTION
        ...
        # END SOLUTION

The student package is a copy of every ref module in which each such region
becomes ``raise NotImplementedError("Task N (name): ...")``: signatures,
docstrings, shape comments and module-level helpers stay, and nothing is kept
by hand, so the stubs can never drift from the solution. Imports of
``minivllm.ref.X`` are pointed at the package's own ``X``; components that use
another component (the scheduler its KV cache manager and allocator) get it
through the swap layer, which serves the package's own module.

The package provides every component as a submodule, which is what the swap
layer looks for: ``pytest --backend=PKG``, ``LLM(..., backend="PKG")`` and
``minivllm generate --backend PKG`` run it (with ``DIR`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from minivllm.course.manifest import TASKS, Task

BEGIN = "# BEGIN SOLUTION"
END = "# END SOLUTION"
CPP_BEGIN = "// BEGIN SOLUTION"
CPP_END = "// END SOLUTION"
_PACKAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ROOT = Path(__file__).resolve().parent.parent  # the minivllm package


@dataclass(frozen=True)
class Region:
    """One solution region: lines ``begin`` .. ``end`` (0-based, the marker lines)."""

    begin: int
    end: int
    indent: str
    function: str  # qualified name of the enclosing function, e.g. "BlockAllocator.free"


def source_path(source: str, module: str) -> Path:
    """Where the solution of ``module`` lives: ``minivllm/<source>/<module>.py``."""
    return _ROOT / source / f"{module}.py"


def handout_name(task: Task) -> str:
    """The handout page of ``task`` under ``docs/course/``."""
    return f"{task.number:02d}_{task.name}.md"


def _functions_by_line(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, 1-based, outer first."""
    found = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.lineno, node.end_lineno, prefix + node.name))
                walk(node.body, prefix + node.name + ".")
            elif isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")

    walk(tree.body, "")
    return found


def _scan(lines: list[str], path: str | Path, begin_marker: str, end_marker: str,
          owner) -> list[Region]:
    """The regions between ``begin_marker`` and ``end_marker`` lines, in order.

    ``owner(begin)`` names the function a region opened on 0-based line ``begin``
    belongs to (or raises ``ValueError``); a marker out of place is a ``ValueError``
    naming the file and line.
    """
    regions, begin = [], None
    for i, line in enumerate(lines):
        marker = line.strip()
        if marker == begin_marker:
            if begin is not None:
                raise ValueError(f"{path}:{i + 1}: {begin_marker} inside the region opened on "
                                 f"line {begin + 1}")
            begin = i
        elif marker == end_marker:
            if begin is None:
                raise ValueError(f"{path}:{i + 1}: {end_marker} without a {begin_marker}")
            indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
            regions.append(Region(begin, i, indent, owner(begin)))
            begin = None
    if begin is not None:
        raise ValueError(f"{path}:{begin + 1}: {begin_marker} is never closed by {end_marker}")
    return regions


def find_regions(text: str, path: str | Path) -> list[Region]:
    """Every solution region of a source file; ``ValueError`` naming the file if malformed."""
    functions = _functions_by_line(ast.parse(text, filename=str(path)))

    def owner(begin: int) -> str:
        inside = [name for first, last, name in functions if first <= begin + 1 <= last]
        if not inside:
            raise ValueError(f"{path}:{begin + 1}: a solution region must lie inside a "
                             f"function body")
        return inside[-1]  # the innermost function

    return _scan(text.splitlines(), path, BEGIN, END, owner)


def find_cpp_regions(text: str, path: str | Path) -> list[Region]:
    """Every ``// BEGIN SOLUTION`` / ``// END SOLUTION`` region of a C++ source file."""
    return _scan(text.splitlines(), path, CPP_BEGIN, CPP_END, lambda begin: "")


def csrc_path(task: Task, name: str) -> Path:
    """Where a C++ source of ``task`` lives: ``minivllm/<source>/csrc/<name>``."""
    return _ROOT / task.source / "csrc" / name


def check_task_regions(task: Task) -> list[str]:
    """What is wrong with ``task``'s markers (an empty list when every region exists)."""
    problems = []
    for name in task.csrc:
        path = csrc_path(task, name)
        if not path.exists():
            problems.append(f"task {task.name}: {path} does not exist")
        elif not find_cpp_regions(path.read_text(), path):
            problems.append(f"task {task.name}: {path} has no {CPP_BEGIN} / {CPP_END} regions")
    path = source_path(task.source, task.module)
    if not path.exists():
        return problems + [f"task {task.name}: {path} does not exist"]
    if task.csrc:
        return problems  # the Python module only builds and calls the C++ code
    regions = find_regions(path.read_text(), path)
    if not regions:
        return [f"task {task.name}: {path} has no {BEGIN} / {END} regions"]
    have = {r.function for r in regions}
    return [f"task {task.name}: {path} has no solution region in {f}"
            for f in task.functions if f not in have]


def stub_cpp(text: str, path: str | Path, task: Task) -> str:
    """The student version of a C++ source: every region a ``TORCH_CHECK(false, ...)``."""
    lines = text.splitlines(keepends=True)
    for region in reversed(find_cpp_regions(text, path)):
        what = (f"Task {task.number} ({task.name}): write this part of {Path(path).name}; see "
                f"docs/course/{handout_name(task)}")
        lines[region.begin : region.end + 1] = [f'{region.indent}TORCH_CHECK(false, "{what}");\n']
    return "".join(lines)


def solution_cpp(text: str, path: str | Path) -> str:
    """The C++ solution with its marker lines dropped."""
    find_cpp_regions(text, path)
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.strip() not in (CPP_BEGIN, CPP_END))


def _rewrite_imports(text: str, source: str, package: str,
                     modules: set[str] | None = None) -> str:
    """Point ``minivllm.<source>`` imports at the student package.

    With ``modules`` (the package's module names), ``minivllm.ref.X`` and
    ``minivllm.fast.X`` are rewritten for those ``X`` only, so a fast module's
    helpers that the package does not copy (``minivllm.fast._no_triton``) stay.
    """
    if modules is None:
        text = re.sub(rf"\bminivllm\.{source}\.", f"{package}.", text)
        return re.sub(rf"\bfrom minivllm\.{source} import\b", f"from {package} import", text)
    names = "|".join(sorted(modules, key=len, reverse=True))
    text = re.sub(rf"\bminivllm\.(?:ref|fast)\.({names})\b", rf"{package}.\1", text)
    return re.sub(r"\bfrom minivllm\.(?:ref|fast) import\b", f"from {package} import", text)


def stub_file(text: str, path: str | Path, package: str, tasks: tuple[Task, ...] = TASKS,
              source: str = "ref", modules: set[str] | None = None) -> str:
    """The student version of a solution file: every region a ``NotImplementedError``."""
    module = Path(path).stem
    owner = {f: t for t in tasks if t.module == module and t.source == source for f in t.functions}
    lines = text.splitlines(keepends=True)
    regions = find_regions(text, path)
    if not regions and any(t.module == module and t.source == source and not t.csrc
                           for t in tasks):
        raise ValueError(f"{path} has no {BEGIN} / {END} regions, but a task grades it")
    for region in reversed(regions):
        task = owner.get(region.function)
        what = (f"Task {task.number} ({task.name}): write {region.function}; see "
                f"docs/course/{handout_name(task)}") if task else f"write {region.function}"
        stub = f'{region.indent}raise NotImplementedError("{what}")\n'
        lines[region.begin : region.end + 1] = [stub]
    return _rewrite_imports("".join(lines), source, package, modules)


def solution_file(text: str, path: str | Path, package: str, source: str = "ref",
                  modules: set[str] | None = None) -> str:
    """The solution as a package of its own: the marker lines dropped, imports pointed at it."""
    find_regions(text, path)  # refuse malformed markers here too
    kept = [line for line in text.splitlines(keepends=True) if line.strip() not in (BEGIN, END)]
    return _rewrite_imports("".join(kept), source, package, modules)


def _init_text(package: str, solution: bool, tasks: tuple[Task, ...]) -> str:
    kind = "solution (every task done)" if solution else "student package"
    rows = "\n".join(f"  {t.number:2d}. {t.name:<20} {t.module}.py: {', '.join(t.functions)}"
                     for t in tasks)
    return (f'"""minivllm course: {kind}, generated by `minivllm course make-student`.\n\n'
            f"Each module is a component of the engine; the swap layer uses it with\n"
            f"`pytest --backend={package}` or `minivllm generate --backend {package}`\n"
            f"(with this package's parent directory on PYTHONPATH).\n\n"
            f"Tasks (docs/course/ has a page for each):\n{rows}\n\n"
            f"Grade: minivllm course grade --backend {package} [--task NAME]\n"
            f'"""\n')


def make_student(dest: str | Path, package: str = "minivllm_student", solution: bool = False,
                 tasks: tuple[Task, ...] = TASKS, overwrite: bool = False) -> Path:
    """Write the package ``dest/package``; return its directory.

    Args:
        dest: the directory to create the package in (put it on ``PYTHONPATH``).
        package: the package's import name.
        solution: write the solution instead of the stubs (for instructors' checks).
        tasks: the tasks whose regions become stubs.
        overwrite: replace the package's files if it already exists.
    """
    if not _PACKAGE_NAME.match(package):
        raise ValueError(f"package must be a Python identifier, got {package!r}")
    pkg_dir = Path(dest) / package
    if pkg_dir.exists() and not overwrite:
        raise ValueError(f"{pkg_dir} already exists; pick another directory or pass overwrite")
    pkg_dir.mkdir(parents=True, exist_ok=True)
    # Every ref module (so the package serves every component itself) ...
    sources = {p.stem: ("ref", p) for p in sorted((_ROOT / "ref").glob("*.py"))
               if p.stem != "__init__"}
    # ... except where a kernel task's solution is the fast twin.
    for task in tasks:
        if task.source == "fast":
            sources[task.module] = ("fast", source_path("fast", task.module))
    modules = set(sources)
    for module, (source, path) in sources.items():
        text = path.read_text()
        if solution:
            out = solution_file(text, path, package, source, modules)
        else:
            out = stub_file(text, path, package, tasks, source, modules)
        (pkg_dir / f"{module}.py").write_text(out)
    # C++ tasks: their sources, stubbed, and the headers they include, under csrc/.
    for task in tasks:
        for name in task.csrc + task.csrc_headers:
            src = csrc_path(task, name)
            text = src.read_text()
            if name in task.csrc:
                text = solution_cpp(text, src) if solution else stub_cpp(text, src, task)
            (pkg_dir / "csrc").mkdir(exist_ok=True)
            (pkg_dir / "csrc" / name).write_text(text)
    (pkg_dir / "__init__.py").write_text(_init_text(package, solution, tasks))
    return pkg_dir
