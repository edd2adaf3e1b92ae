"""``minivllm course ...``: the course kit's commands (``minivllm course --help``)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

EXAMPLES = """examples:
    minivllm course tasks                                   # the task list and points
    minivllm course make-student hw                         # stubs in hw/minivllm_student/
    PYTHONPATH=hw minivllm course grade --backend minivllm_student
    PYTHONPATH=hw minivllm course grade --backend minivllm_student --task rms_norm
    minivllm course grade --backend PKG --path hw --extra-tests private_tests/ --json g.json
    minivllm course grade --backend PKG --path hw --gradescope /autograder/results/results.json
    minivllm course submit hw/minivllm_student              # zip it for hand-in
    minivllm course selfcheck                               # every mutant must fail its task

Handouts: docs/course/ (one page per task, and README.md for instructors).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm course",
        description="Course kit: generate student packages from the ref, grade them task by "
                    "task with the test suite, and check that the tests catch realistic bugs.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    sub = parser.add_subparsers(dest="action", required=True)

    sub.add_parser("tasks", help="list the tasks: number, name, component, points, reading")

    p = sub.add_parser("make-student", help="write a student package of stubs made from the ref")
    p.add_argument("dir", help="directory to write the package into (put it on PYTHONPATH)")
    p.add_argument("--package", default="minivllm_student",
                   help="the package's import name (default: %(default)s)")
    p.add_argument("--solution", action="store_true",
                   help="write the full solution instead of stubs (instructors only)")
    p.add_argument("--force", action="store_true", help="overwrite an existing package")

    p = sub.add_parser("grade", help="grade a package task by task; exit 0 only at full marks")
    p.add_argument("--backend", required=True, help="the package's import name")
    p.add_argument("--task", action="append", default=None,
                   help="grade only this task (repeatable; default: every task)")
    p.add_argument("--path", action="append", default=["."],
                   help="directory to put on PYTHONPATH, relative to this folder (repeatable; "
                        "default: .)")
    p.add_argument("--extra-tests", action="append", default=[], metavar="DIR",
                   help="an instructor's private tests (files test_task_<name>.py or tests "
                        "marked task_<name>); a failing one zeroes its task")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--junit", default=None, metavar="PATH", help="write JUnit XML")
    p.add_argument("--gradescope", default=None, metavar="PATH",
                   help="write Gradescope's autograder results.json")
    p.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS",
                   help="a test running longer fails (default: %(default)s)")

    p = sub.add_parser("submit", help="zip a student package for hand-in")
    p.add_argument("package_dir", help="the package directory, e.g. hw/minivllm_student")
    p.add_argument("-o", "--output", default=None, help="the zip file (default: <name>-submission.zip)")

    p = sub.add_parser("selfcheck", help="grade every mutant (a one-line bug); each must fail")
    p.add_argument("--task", action="append", default=None, help="only this task's mutants")
    p.add_argument("--mutant", action="append", default=None, help="only this mutant")
    p.add_argument("--jobs", type=int, default=2, help="mutants graded at once (default: 2)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run one ``minivllm course`` action; return the exit status.

    SIGTERM becomes ``SystemExit`` (as Ctrl-C becomes ``KeyboardInterrupt``), so
    the grader's ``finally`` blocks stop its pytest children and all they started.
    """
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.action == "tasks":
        from minivllm.course.manifest import TASKS, total_points

        for t in TASKS:
            print(f"{t.number:2d}. {t.name:<20} {t.component:<16} {t.points:>3} pts  {t.title}")
            print(f"    write: {', '.join(t.functions)} in {t.module}.py")
            print(f"    read:  {', '.join(t.reading)}")
        print(f"total: {total_points()} points")
        return 0
    if args.action == "make-student":
        from minivllm.course.student import make_student

        pkg = make_student(args.dir, args.package, solution=args.solution, overwrite=args.force)
        print(f"wrote {pkg}")
        print(f"test it: PYTHONPATH={args.dir} minivllm course grade --backend {args.package}")
        print(f"run it:  PYTHONPATH={args.dir} minivllm generate --backend {args.package} "
              f"\"The capital of France is\"")
        return 0
    if args.action == "grade":
        from minivllm.course.grade import grade

        results, table = grade(args.backend, args.task, extra_tests=args.extra_tests,
                               pythonpath=args.path, json_path=args.json, junit_path=args.junit,
                               gradescope_path=args.gradescope, test_timeout=args.timeout)
        print(table)
        return 0 if all(r.score == r.points for r in results) else 1
    if args.action == "submit":
        from minivllm.course.reports import submit

        print(f"wrote {submit(args.package_dir, args.output)}")
        return 0
    from minivllm.course.mutants import MUTANTS, selfcheck

    if args.list:
        for m in MUTANTS:
            print(f"{m.task:<18} {m.name:<32} {m.why}")
        return 0
    results = selfcheck(args.mutant, args.task, jobs=args.jobs)
    survived = [r.mutant.name for r in results if not r.caught]
    print(f"caught {len(results) - len(survived)}/{len(results)} mutants"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0
