"""Contract changes a package written from an older handout trips over, named up front.

When a component's contract changes in a way an older package cannot keep (not a
new keyword-only parameter, which the engine passes only when it is used), the
grader says so before the tests run, with the file, the line and what to do,
instead of a task full of tracebacks. Each check reads the package's source (the
same parse as the grader's scan; nothing is imported or run) and finds only code
that would raise whenever it runs, so a package that keeps the contract is never
refused. :func:`contract_break` is called for every task by
:func:`minivllm.course.manifest.missing_for_task`.

So far one change: ``SchedulerOutput`` became frozen (a pipeline keeps several
steps in flight, and each must read its step as decided), so a scheduler that
makes an empty one and fills it in (``so.scheduled_requests.append(r)``,
``so.num_scheduled_tokens[rid] = n``, ``so.total_num_scheduled_tokens += n``: the
handout before that round) can only fail.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

#: Methods that change a list, dict or set in place.
_MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "clear", "update",
                       "setdefault", "add", "discard", "sort", "reverse", "popitem"})


def _output_fields() -> frozenset[str]:
    from minivllm.metadata import SchedulerOutput

    return frozenset(f.name for f in dataclasses.fields(SchedulerOutput))


def _field_written(node: ast.AST, names: set[str], fields: frozenset[str]) -> str | None:
    """``"so.field"`` if ``node`` writes field ``field`` of a name in ``names``, else None."""
    def target(expr: ast.AST) -> str | None:  # ``so.field`` itself
        if (isinstance(expr, ast.Attribute) and expr.attr in fields
                and isinstance(expr.value, ast.Name) and expr.value.id in names):
            return f"{expr.value.id}.{expr.attr}"
        return None

    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            hit = target(t) or (target(t.value) if isinstance(t, ast.Subscript) else None)
            if hit:
                return hit
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS):
        return target(node.func.value)
    return None


def filled_in_scheduler_outputs(source: str) -> list[tuple[int, str]]:
    """``(line, "so.field")`` for each write into a ``SchedulerOutput`` after it was made.

    Within one function: a name bound to ``SchedulerOutput(...)``, then one of
    its fields assigned, augmented, deleted, item-assigned or changed in place.
    Each of those raises on the frozen dataclass and its immutable containers.
    """
    tree, fields, found = ast.parse(source), _output_fields(), []
    # The class under any name it is imported as (``... import SchedulerOutput as Out``).
    makers = {"SchedulerOutput"} | {a.asname for node in ast.walk(tree)
                                    if isinstance(node, ast.ImportFrom) for a in node.names
                                    if a.name == "SchedulerOutput" and a.asname}
    for scope in ast.walk(tree):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = {t.id for node in ast.walk(scope) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call)
                 and getattr(node.value.func, "id", getattr(node.value.func, "attr", ""))
                 in makers
                 for t in node.targets if isinstance(t, ast.Name)}
        if names:
            found += [(node.lineno, hit) for node in ast.walk(scope)
                      if (hit := _field_written(node, names, fields))]
    return sorted(set(found))


def contract_break(module, component: str, where: str) -> str | None:
    """Why ``module`` (a package's ``component``) cannot keep today's contract, or None."""
    if component != "scheduler":
        return None
    try:
        source = inspect.getsource(module)
    except (TypeError, OSError):  # an attribute made at run time: nothing to read
        return None
    writes = filled_in_scheduler_outputs(source)
    if not writes:
        return None
    line, write = writes[0]
    file = module.__name__.replace(".", "/") + ".py"
    # Short enough for the grader's one-line failures (400 characters).
    return (f"{file}:{line}: `{write}` fills in a SchedulerOutput after making it (the "
            f"previous handout's way); it is frozen now (docs/course/05_scheduler.md, 'What the "
            f"engine calls'): collect the step in your own lists and dicts, then build it in "
            f"one call, SchedulerOutput(scheduled_requests=..., ...). {where} cannot run until "
            f"then.")
