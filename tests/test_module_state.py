"""No hidden module state: every module-level mutable name in ``minivllm/`` is a decision.

A module-level ``None``, a mutable container (empty *or filled*: a table that
anything may append to is state) or a ``global`` statement is how hidden
state creeps in (a flag flipped from elsewhere, a cache keyed on an object, a
"last plan" another call reads, a registry patched at run time). This test
lists them all by parsing the source and fails on any not in :data:`ALLOWED`,
so a new one has to be added here, with its reason, in review. A constant
table is written as one that cannot change: a tuple, a ``frozenset`` or a
``MappingProxyType``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import minivllm

ROOT = Path(minivllm.__file__).parent

#: (file relative to minivllm/, name) -> why it may be module state.
ALLOWED: dict[tuple[str, str], str] = {
    ("backend.py", "_global_spec"): "the swap layer's global spec (set_backend / use_backend)",
    ("backend.py", "_cache"): "the swap layer's import cache: (package, component) -> module",
    ("backend.py", "_warned"): "fallback warnings already shown, so each is shown once",
    # The tensor-parallel group of this process (set once by init_distributed, per rank).
    ("distributed.py", "_TP_RANK"): "this process's tensor-parallel rank",
    ("distributed.py", "_TP_SIZE"): "the tensor-parallel world size",
    ("distributed.py", "_CPU_GROUP"): "the gloo group for host-side collectives",
    ("distributed.py", "_CONTROL_GROUP"): "the group workers wait on for commands",
    # Pipeline parallelism (set once by init_distributed, per rank, like vLLM's parallel_state).
    ("distributed.py", "_PP_RANK"): "this process's pipeline stage",
    ("distributed.py", "_PP_SIZE"): "the number of pipeline stages",
    ("distributed.py", "_TP_GROUP"): "this stage's tensor-parallel group (None: the world)",
    ("distributed.py", "_WORLD_CPU_GROUP"): "the world-wide gloo group (stage-to-stage traffic)",
    ("distributed.py", "_WORLD_CONTROL_GROUP"): "the world-wide group workers wait on",
    ("distributed.py", "_STATS"): "where this rank's collectives are timed, given to "
                                  "init_distributed with the group (None: not timed)",
    ("course/child.py", "_LIVE"): "the grader's running pytest children, so that a stopped "
                                  "grader (SIGTERM, Ctrl-C) can kill their process groups",
    ("testing/pytest_plugin.py", "_TIMEOUT"): "the run's --test-timeout, set once when pytest "
                                              "configures the plugin",
}

#: Files another change rewrites; an exemption here is temporary.
SKIPPED: set[str] = set()

#: Constructors of mutable containers: state, with or without arguments.
_MUTABLE_CALLS = {"set", "dict", "list", "defaultdict", "deque", "OrderedDict", "Counter",
                  "WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "ref", "finalize",
                  "bytearray"}


def _is_mutable(value: ast.expr | None) -> bool:
    if value is None:
        return False
    if isinstance(value, ast.Constant):
        return value.value is None  # a None placeholder is filled in later: state
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp,
                          ast.SetComp)):
        return True  # empty or filled, anything may change it later
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _MUTABLE_CALLS or (
            isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "weakref")
    return False


def _top_level(body: list[ast.stmt]):
    """Statements at module level, looking inside top-level if/try blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top_level(block)


def module_state(path: Path) -> set[str]:
    """Names a module binds to None / an empty or mutable container, or declares global."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in _top_level(tree.body):
        if isinstance(node, ast.Assign) and _is_mutable(node.value):
            # __all__ is the module's list of public names, read by tools, never state.
            names |= {t.id for t in node.targets
                      if isinstance(t, ast.Name) and t.id != "__all__"}
        elif isinstance(node, ast.AnnAssign) and _is_mutable(node.value):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names |= set(node.names)
    return names


def find_all() -> dict[tuple[str, str], Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in SKIPPED:
            continue
        for name in module_state(path):
            found[(rel, name)] = path
    return found


def test_no_undeclared_module_state():
    found = find_all()
    new = sorted(set(found) - set(ALLOWED))
    assert not new, (
        f"module-level mutable state {new}: pass it explicitly (an argument, a field of "
        "a config or metadata dataclass), or add it to ALLOWED with the reason"
    )


def test_allow_list_is_current():
    """Every allowed name still exists, so the list shrinks when state goes away."""
    stale = sorted(set(ALLOWED) - set(find_all()))
    assert not stale, f"remove {stale} from ALLOWED: no longer module state"


def test_the_detector_sees_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import weakref\nfrom collections import deque\nfrom types import MappingProxyType\n"
        "A = None\nB: dict = {}\nC = []\nD = set()\nE = deque()\nF = weakref.WeakSet()\n"
        "G = (1, 2)\nH = {'k': 1}\nI = 'x'\nL = dict(a=1)\nM = [1, 2]\nN = {1}\n"
        "O = frozenset({1})\nP = MappingProxyType({'k': 1})\nQ = {k: 1 for k in 'ab'}\n"
        "if True:\n    J = None\n"
        "def f():\n    global K\n    K = 1\n"
    )
    assert module_state(src) == set("ABCDEFHJKLMNQ")
