"""The fine-tuning methods as data: names, options (defaults, valid values), phases, privacy.

One table (:data:`SPECS`, name -> :class:`MethodSpec`) read by both sides:

* the library: every :class:`sparta_tf.methods.Method` class is declared with
  its spec (``class Sparta(SelectionEpochMethod, spec=SPECS["sparta"])``),
  which registers it in :data:`sparta_tf.methods.METHODS`, one class per spec;
  its phases are the spec's :class:`Phase` templates given their epochs, and
  :meth:`MethodSpec.resolve` checks the options a caller gives and fills in
  the defaults; the layers
  below the methods take their choices from here too (``selection.frost``'s
  paper defaults, ``selection.scoring``'s scores, ``ssgd``'s dropping modes);
* the ``sparta-train`` config checker (:mod:`trainers.config`), which checks a
  config without importing TensorFlow and loads this file on its own.

So this module imports nothing but the standard library. It is a top-level
module rather than part of :mod:`sparta_tf.methods` because the modules
below the methods import it: importing it must not import the Method
classes (which import those modules).

An option value of ``None`` (``null`` in a config) means the option's default.
Options of one name mean the same thing and take the same types in every
method that has them; their defaults and valid values may differ (``score``,
``granularity``): a value valid for another method's option of that name but
not for this method's is what ``sparta-train`` drops with a note when a
config switches ``method.name``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Mapping, Protocol

# ---------------------------------------------------------------- valid values


class Check(Protocol):
    """A rule for an option's value: :meth:`problem` says what is wrong (None: nothing)."""

    def problem(self, value: Any) -> str | None: ...


@dataclasses.dataclass(frozen=True)
class OneOf:
    """``value in choices``; ``label`` (e.g. "a score of sparta") words the error as "is not LABEL"."""

    choices: tuple
    label: str | None = None

    def problem(self, value: Any) -> str | None:
        if value in self.choices:
            return None
        if self.label is not None:
            return f"is not {self.label}; use {' or '.join(map(str, self.choices))}"
        return f"must be one of {', '.join(map(str, self.choices))}"

    def __str__(self) -> str:
        return f"one of {', '.join(map(str, self.choices))}"


@dataclasses.dataclass(frozen=True)
class Interval:
    """``low <= value <= high``, either end open (strict) or absent."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def problem(self, value: Any) -> str | None:
        return None if self.contains(value) else f"must be {self}"

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_bound(self.low)}"
        return (f"in {'(' if self.low_open else '['}{_bound(self.low)}, {_bound(self.high)}"
                f"{')' if self.high_open else ']'}")


def _bound(x: float) -> str:
    """``x`` as a reader writes it: ``0.5``, ``1``, ``2**63``."""
    if isinstance(x, int) and x > 2**32 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}"


FRACTION = Interval(0, 1)
"""``[0, 1]``: a density."""


@dataclasses.dataclass(frozen=True)
class DensityMap:
    """A mapping of layer-name patterns to densities in ``[0, 1]``."""

    def problem(self, value: Any) -> str | None:
        for pattern, density in value.items():
            if not isinstance(density, (int, float)) or isinstance(density, bool) or not FRACTION.contains(density):
                return f"has {pattern!r}: {density!r}; every density must be a number in [0, 1]"
        return None

    def __str__(self) -> str:
        return "a mapping of layer-name patterns to densities in [0, 1]"


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "a mapping",
               type(None): "null"}


def type_problem(value: Any, types: tuple[type, ...]) -> str | None:
    """What is wrong with the type of ``value`` given the allowed ``types`` (a bool is not an int,
    a float must be finite), or None."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        return "must be " + " or ".join(dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in types))
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    return None


# ---------------------------------------------------------------- options and methods

NUMBER = (int, float)
INT = (int,)
_NONE = type(None)


@dataclasses.dataclass(frozen=True)
class Option:
    """One method option: its default, the types it takes, what values are valid, what it means.

    ``None`` is accepted when ``NoneType`` is among ``types``, and means ``default``."""

    name: str
    default: Any
    types: tuple[type, ...]
    doc: str
    valid: Check | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this option (type, then validity), or None."""
        if value is None and _NONE in self.types:
            return None
        return type_problem(value, self.types) or (self.valid.problem(value) if self.valid else None)

    def value_or_default(self, value: Any) -> Any:
        """``value``, or a fresh copy of the default when ``value`` is None."""
        return copy.deepcopy(self.default) if value is None else value


@dataclasses.dataclass(frozen=True)
class Phase:
    """One training phase: ``epochs`` epochs of DP steps labelled ``name`` in the ledger.

    The one phase type, at three stages of a run:

    * in a :class:`MethodSpec`, a template: ``epochs`` is None (it depends on
      the run's ``T``), ``length`` and ``trains`` say in words how many epochs
      and what the phase trains (the config reference prints them);
    * from :meth:`sparta_tf.methods.Method.phases`, the phase of a fit of ``T``
      epochs: the template with its ``epochs`` (:meth:`lasting`), the epochs
      of a fit's phases summing to ``T``;
    * in a :class:`~sparta_tf.privacy.plan.PrivacyPlan`, planned: also its
      ``steps = epochs * steps_per_epoch`` and the ``epsilon_after`` the
      composition of every mechanism up to its last step (:meth:`planned`).

    ``updates``: False for a phase whose steps release a statistic and update
    no weight (SPARTA's selection epoch).
    """

    name: str
    epochs: int | None = None
    updates: bool = True
    steps: int | None = None
    epsilon_after: float | None = None
    length: str = dataclasses.field(default="", repr=False)
    trains: str = dataclasses.field(default="", repr=False)

    def lasting(self, epochs: int) -> "Phase":
        """This phase for ``epochs`` epochs of a fit."""
        return dataclasses.replace(self, epochs=int(epochs))

    def planned(self, steps: int, epsilon_after: float) -> "Phase":
        """This phase as the privacy plan holds it: its DP ``steps`` and the epsilon after them."""
        return dataclasses.replace(self, steps=int(steps), epsilon_after=float(epsilon_after))


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method: ``name``, one-line ``summary``, ``options``, training ``phases`` in order,
    ``before_training`` (what it chooses, and charges, before the first step; None: nothing), and
    ``private`` (False: its choices look at private data without noise)."""

    name: str
    summary: str
    options: tuple[Option, ...]
    phases: tuple[Phase, ...]
    before_training: str | None = None
    private: bool = True

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(option.name for option in self.options)

    def option(self, name: str) -> Option:
        for option in self.options:
            if option.name == name:
                return option
        raise ValueError(f"method {self.name!r} has no option {name!r}; its options: {self._accepted()}")

    def phase(self, name: str) -> Phase:
        """The template of phase ``name`` (see :class:`Phase`)."""
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise ValueError(f"method {self.name!r} has no phase {name!r}; its phases: "
                         f"{', '.join(p.name for p in self.phases)}")

    def defaults(self) -> dict[str, Any]:
        """Every option at its default."""
        return {option.name: copy.deepcopy(option.default) for option in self.options}

    def resolve(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every option: the value in ``given`` when it is valid (None: the default), else the default
        when it is absent; a one-line ValueError naming the first unknown option or bad value."""
        unknown = [key for key in given if key not in self.option_names]
        if unknown:
            raise ValueError(f"method {self.name!r} has no option {unknown[0]!r}; its options: {self._accepted()}")
        resolved = self.defaults()
        for key, value in given.items():
            problem = self.option(key).problem(value)
            if problem:
                raise ValueError(f"{key}={value!r} {problem}")
            resolved[key] = self.option(key).value_or_default(value)
        return resolved

    def _accepted(self) -> str:
        return ", ".join(self.option_names) or "none (only the options every method takes)"


# ---------------------------------------------------------------- the shared vocabulary

GRANULARITIES = ("row", "entry")
"""What a mask keeps: whole rows (output units) or single entries of a kernel."""
SELECTION_SCORES = {"sparta": ("sum_abs", "abs_sum"), "dpsgd_grad": ("signed",), "oracle": ("oracle",)}
"""The scores of each selection-epoch method; the first is its default."""
SCORES = tuple(score for scores in SELECTION_SCORES.values() for score in scores)
"""Every score a selection epoch computes (:mod:`sparta_tf.selection.scoring`)."""
FROST_MAGNITUDES = ("mg", "mgn", "mgna")
"""DP-FROST's partition-gradient magnitudes (DP-MG, DP-MGN, DP-MGNA)."""
PRUNE_MODES = ("none", "random", "synflow", "dp_snip")
"""DP-SSGD's pre-pruning."""
DROP_MODES = ("random", "magnitude")
"""DP-SSGD's gradient dropping."""


def default_warmup_epochs(epochs: int) -> int:
    """``T0 = T / 5`` (the paper's 10 of 50), at least 1: the warm-up of a selection-epoch method."""
    return max(1, epochs // 5)


DENSITY = Option("density", 0.2, NUMBER, "fraction of each maskable kernel's rows (or entries) the mask keeps, "
                 "at least one per layer", FRACTION)
DENSITY_OVERRIDES = Option("density_overrides", {}, (dict,), "density per layer-name pattern (fnmatch), "
                           "overriding density", DensityMap())


def _granularity(default: str, valid: tuple[str, ...] = GRANULARITIES) -> Option:
    return Option("granularity", default, (str, _NONE), "what the mask keeps: row (output units) or entry",
                  OneOf(valid))


def _mask_options(granularity: Option) -> tuple[Option, ...]:
    return DENSITY, granularity, DENSITY_OVERRIDES


def _selection_options(method: str, granularity: Option) -> tuple[Option, ...]:
    scores = SELECTION_SCORES[method]
    return (
        Option("warmup_epochs", None, (int, _NONE), "T0, the DP-BitFit epochs before the selection epoch "
               "(null: T/5, at least 1)", Interval(0)),
        Option("score", scores[0], (str, _NONE), "the noisy statistic the selection epoch releases",
               OneOf(scores, label=f"a score of {method}")),
        Option("mask", None, (str, _NONE), "a saved mask directory: the selection epoch is skipped and what "
               "choosing that mask cost is charged before training"),
    ) + _mask_options(granularity)


def _selection_phases(rows: str) -> tuple[Phase, ...]:
    return (
        Phase("warmup", length="warmup_epochs", trains="biases + norms + head (DP-BitFit)"),
        Phase("selection", updates=False, length="1 (none with mask)",
              trains="nothing: releases the noisy scores, updates no weight"),
        Phase("sparse", length="the rest", trains=f"the DP-BitFit set + the selected {rows}"),
    )


def _whole(name: str, summary: str, trains: str) -> MethodSpec:
    return MethodSpec(name, summary, (), (Phase(name, length="T", trains=trains),))


def _static_mask(name: str, summary: str, options: tuple[Option, ...]) -> MethodSpec:
    return MethodSpec(name, summary, options, (Phase(name, length="T", trains="the DP-BitFit set + the mask"),))


_FROST = (
    Option("frost_magnitude", "mgna", (str,), "partition-gradient magnitude (DP-MG, DP-MGN, DP-MGNA)",
           OneOf(FROST_MAGNITUDES)),
    Option("frost_alpha", 1, INT, "norm order alpha of the magnitudes", OneOf((1, 2))),
    Option("r_eps", 0.9, NUMBER, "share of the target epsilon the training steps spend on their own",
           Interval(0, 1, True, True)),
    Option("frost_iterations", 5, INT, "T, the selection rounds (PSEL)", Interval(1)),
    Option("q_ps", 0.02, NUMBER, "Poisson rate of each selection round", Interval(0, 1, True, True)),
    Option("nu", 5.0, NUMBER, "gap, in standard deviations, a partition's magnitude must clear",
           Interval(0, None, True)),
    Option("gamma", 0.2, NUMBER, "most trainable parameters, as a fraction of |Theta|", Interval(0, 1, True, False)),
)
_SSGD = (
    Option("prune", "random", (str,), "pre-pruning: none, random, synflow (data-free), dp_snip (one "
           "Gaussian release, charged)", OneOf(PRUNE_MODES)),
    Option("prune_rate", 0.5, NUMBER, "fraction of each prunable kernel pruned before training",
           Interval(0, 1, False, True)),
    Option("drop_rate", 0.5, NUMBER, "fraction of the kept coordinates dropped at every step",
           Interval(0, 1, False, True)),
    Option("drop_mode", "random", (str,), "which coordinates a step drops", OneOf(DROP_MODES)),
    Option("snip_noise_multiplier", 5.0, NUMBER, "noise multiplier of the DP-SNIP release", Interval(0, None, True)),
    Option("synflow_iterations", 100, INT, "SynFlow's pruning iterations", Interval(1)),
)

SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("sparta", "SPARTA: private row scores in one selection epoch, then the top rows per layer",
               _selection_options("sparta", _granularity("row")), _selection_phases("rows")),
    _whole("all", "every trainable variable", "every trainable variable"),
    _whole("last", "head + normalisation parameters", "head + norms"),
    _whole("bitfit", "biases + norms + head (DP-BitFit)", "biases + norms + head"),
    _static_mask("mp", "the DP-BitFit set + the largest pre-trained weights per layer (free: public weights)",
                 _mask_options(_granularity("entry"))),
    _static_mask("random", "the DP-BitFit set + uniformly random rows per layer (free: data-independent)",
                 _mask_options(_granularity("row")) + (Option(
                     "seed", None, (int, _NONE), "explicit seed of the random mask, overriding the run's "
                     "public seed (null, the default: the public seed's \"random_mask\" stream)", Interval(0, 2**63, False, True)),)),
    MethodSpec("dpsgd_grad", "as sparta, entries of largest averaged noisy DP-SGD gradient (paper Alg. 2)",
               _selection_options("dpsgd_grad", _granularity("entry", ("entry",))), _selection_phases("entries")),
    MethodSpec("oracle", "as sparta, entries of largest exact |g| (paper Alg. 3): NOT private",
               _selection_options("oracle", _granularity("entry")), _selection_phases("entries"), private=False),
    MethodSpec("x_bitfit", "DP-BiTFiT two-phase: full fine-tuning, then the bias terms", (
        Option("full_epochs", 1, INT, "X, the epochs of full fine-tuning", Interval(0)),
        Option("bitfit_learning_rate_scale", 5.0, NUMBER, "learning-rate multiplier of the bias phase",
               Interval(0, None, True)),
    ), (Phase("full", length="full_epochs", trains="every trainable variable"),
        Phase("bias_terms", length="the rest", trains="layer biases + norm offsets + head"))),
    MethodSpec("dp_frost", "DP-FROST: the layers (partitions) PSEL selects, up to gamma |Theta|", _FROST,
               (Phase("dp_frost", length="T", trains="the selected partitions"),),
               before_training="frost_iterations noisy partition-magnitude rounds, charged"),
    MethodSpec("dp_ssgd", "DP-SSGD: pre-pruning, then a random subset of the kept entries at every step", _SSGD,
               (Phase("dp_ssgd", length="T", trains="the kept entries, a drop_rate fraction dropped per step"),),
               before_training="pre-pruning (dp_snip: one Gaussian release, charged)"),
)}
"""Every method, by name."""
DEFAULT_METHOD = "sparta"
"""The method of a config that names none."""


def method_spec(name: str) -> MethodSpec:
    """The spec of method ``name`` (a one-line ValueError naming the methods for an unknown one)."""
    if name not in SPECS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(SPECS)}")
    return SPECS[name]


def options_named(name: str) -> list[tuple[MethodSpec, Option]]:
    """Every method that has an option ``name``, with its version of the option."""
    return [(spec, option) for spec in SPECS.values() for option in spec.options if option.name == name]


ALL_OPTIONS: tuple[str, ...] = tuple(dict.fromkeys(o.name for spec in SPECS.values() for o in spec.options))
"""Every option name of some method, in table order."""
