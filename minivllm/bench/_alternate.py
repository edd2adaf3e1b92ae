"""Numbers that survive a noisy machine: alternated runs, their median and spread.

A laptop, or a shared CI machine, is never idle: one run of a benchmark can be
three times slower than the next. A ratio of one run per side says little, so
the comparisons (``bench throughput --compare llamacpp``, ``bench latency``'s
fast and plain paths) measure each side several times, *alternating* the sides
(A B, B A, A B, ...: a slow minute hits both, and neither side always runs
first), and report per figure the median and the spread (max - min) / median
of its runs. A figure whose spread is over :data:`NOISY_SPREAD` is marked
noisy: its ratio is not evidence, run it again on a quieter machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: A spread (max - min) / median above this marks a figure as noisy.
NOISY_SPREAD = 0.15


@dataclass(frozen=True)
class Figure:
    """One figure measured ``len(runs)`` times."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.0 for one run, or when every run agrees."""
        m = self.median
        return (max(self.runs) - min(self.runs)) / m if m else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    def __str__(self) -> str:
        """``57.3±8%`` (and `` noisy`` past the threshold)."""
        return f"{self.median:.1f}±{self.spread:.0%}" + (" noisy" if self.noisy else "")

    def as_dict(self) -> dict:
        return {"median": self.median, "spread": self.spread, "noisy": self.noisy,
                "runs": list(self.runs)}


def alternate(sides: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Run every side ``repeats`` times, alternating: round ``r`` starts at side ``r``
    (mod the number of sides) and goes round once. Returns each side's results, in order."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(sides)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            out[name].append(sides[name]())
    return out


def figures(runs: list[Mapping]) -> dict:
    """Per key of the runs' (nested) dicts of numbers: a :class:`Figure` of its values.

    ``figures([{"a": 1.0, "b": {"c": 2.0}}, {"a": 3.0, "b": {"c": 2.0}}])`` is
    ``{"a": Figure((1.0, 3.0)), "b": {"c": Figure((2.0, 2.0))}}``; keys missing
    from a run, or holding something else than a number, are left out.
    """
    out: dict = {}
    for key in runs[0]:
        values = [run.get(key) for run in runs]
        if all(isinstance(v, Mapping) for v in values):
            out[key] = figures(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = Figure(tuple(float(v) for v in values))
    return out


def as_json(tree: Any) -> Any:
    """A tree of :class:`Figure` s as plain dicts, for the benchmarks' JSON."""
    if isinstance(tree, Figure):
        return tree.as_dict()
    if isinstance(tree, Mapping):
        return {str(k): as_json(v) for k, v in tree.items()}
    return tree
