"""The course kit: tasks, generated student packages, a grader and a mutation self-check.

- :mod:`minivllm.course.manifest`: the ordered task list (:data:`TASKS`).
- :mod:`minivllm.course.student`: ``make-student``, stubs generated from the ref.
- :mod:`minivllm.course.grade`: ``grade`` and ``submit``.
- :mod:`minivllm.course.mutants`: realistic one-line bugs, ``selfcheck``.
- :mod:`minivllm.course.contracts`: contract changes an older package trips over, named
  before its tests run (a filled-in ``SchedulerOutput``).

See ``docs/course/README.md`` (the instructor's page) and the ``minivllm course`` command.
"""
