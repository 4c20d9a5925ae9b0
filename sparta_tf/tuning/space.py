"""The search space of a private tuning: each candidate draws every hyperparameter independently.

A space maps a name to how its value is drawn::

    {"learning_rate": [0.03, 0.1, 0.3],            # a list: uniformly one of its values
     "clip_norm": {"log_uniform": [0.1, 10]},      # log-uniformly from [low, high]
     "momentum": {"uniform": [0.8, 0.95]}}         # uniformly from [low, high]

Values that must move together (a learning rate and the head's, ten times larger) are a list of points
instead, each candidate drawing one uniformly::

    [{"learning_rate": 0.03, "head_learning_rate": 0.3}, {"learning_rate": 0.1, "head_learning_rate": 1.0}]

A grid is a list per name: each candidate draws one grid point uniformly at random, with replacement.
This is what the analysis asks for (Papernot & Steinke: the repeated mechanism ``Q`` is "draw
hyperparameters, then train", the same for every repetition); a fixed sweep through the grid is not a
repetition of one mechanism. With ``K`` candidates, a grid of ``g`` points is covered with probability
``1 - g (1 - 1/g)^K + ...``: choose the mean of ``K`` for the grid (the tuning page has a table).
The space is public: it must not be chosen by looking at the private data.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import numpy as np

RANGES = ("log_uniform", "uniform")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_space(space: Any, where: str = "space") -> dict | list:
    """``space`` as a dict of validated entries (or a list of points), or a one-line ValueError naming the
    entry and the fix."""
    if isinstance(space, (list, tuple)):
        if not space or not all(isinstance(p, Mapping) and p for p in space):
            raise ValueError(f"{where} as a list must hold points (mappings of name to value), e.g. "
                             "[{learning_rate: 0.03, head_learning_rate: 0.3}, ...]")
        names = set(space[0])
        if any(set(point) != names for point in space):
            raise ValueError(f"{where}: every point must set the same names ({sorted(names)})")
        return [dict(point) for point in space]
    if not isinstance(space, Mapping) or not space:
        raise ValueError(f"{where} must map hyperparameter names to a list of values or {{log_uniform: [low, high]}}"
                         ", e.g. {learning_rate: [0.03, 0.1, 0.3]}")
    checked = {}
    for name, entry in space.items():
        key = f"{where}.{name}"
        if isinstance(entry, (list, tuple)):
            if not entry:
                raise ValueError(f"{key} is an empty list: give the values to choose from")
            checked[name] = list(entry)
        elif isinstance(entry, Mapping) and len(entry) == 1 and next(iter(entry)) in RANGES:
            (kind, bounds), = entry.items()
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and all(map(_is_number, bounds))
                    and bounds[0] < bounds[1]):
                raise ValueError(f"{key}.{kind} must be [low, high] with low < high, got {bounds!r}")
            if kind == "log_uniform" and bounds[0] <= 0:
                raise ValueError(f"{key}.log_uniform needs low > 0, got {bounds!r}")
            checked[name] = {kind: [float(bounds[0]), float(bounds[1])]}
        else:
            raise ValueError(f"{key}={entry!r}: give a list of values or {{log_uniform: [low, high]}} or "
                             "{uniform: [low, high]}")
    return checked


def draw(space: Mapping | list, rng: np.random.Generator) -> dict:
    """One candidate's hyperparameters: each entry drawn independently from ``rng``, in the space's order
    (plain Python values, JSON-serialisable); a list of points: one point, uniformly."""
    if isinstance(space, list):
        return dict(space[int(rng.integers(len(space)))])
    values = {}
    for name, entry in space.items():
        if isinstance(entry, list):
            value = entry[int(rng.integers(len(entry)))]
        else:
            (kind, (low, high)), = entry.items()
            if kind == "log_uniform":
                value = float(math.exp(rng.uniform(math.log(low), math.log(high))))
            else:
                value = float(rng.uniform(low, high))
        values[name] = value.item() if isinstance(value, np.generic) else value
    return values


def corners(space: Mapping | list) -> list[dict]:
    """Every combination of the lists' values and the ranges' ends: the points a check of "does a value
    change the privacy mechanism" must try (a range's value cannot change it but at its ends)."""
    if isinstance(space, list):
        return [dict(point) for point in space]
    combos: list[dict] = [{}]
    for name, entry in space.items():
        values = entry if isinstance(entry, list) else next(iter(entry.values()))
        combos = [dict(combo, **{name: value}) for combo in combos for value in values]
    return combos


def names(space: Mapping | list) -> list[str]:
    """The names a candidate's draw sets."""
    return list(space[0]) if isinstance(space, list) else list(space)


def describe(space: Mapping | list) -> str:
    if isinstance(space, list):
        return "one of " + ", ".join(str(point) for point in space)
    parts = []
    for name, entry in space.items():
        if isinstance(entry, list):
            parts.append(f"{name} one of {entry}")
        else:
            (kind, (low, high)), = entry.items()
            parts.append(f"{name} {kind.replace('_', '-')} in [{low:g}, {high:g}]")
    return "; ".join(parts)
