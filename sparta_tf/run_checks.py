"""The checks of a run's settings that ``make_private`` and ``sparta-train``'s config checker share.

One implementation, two vocabularies: :func:`check_run` (the sizes, the budget, the per-example engine),
:func:`check_method_run` (a method's options against the run's length) and :func:`check_against_data`
(what needs the training-set size ``n``) raise a one-line ``ValueError`` that names the setting as the
caller spells it, the keyword of :func:`sparta_tf.make_private` (:data:`LIBRARY`) or the key of a
config (:data:`CONFIG`, :mod:`trainers.config` turns it into a ``ConfigError``)::

    batch_size=500 is larger than the training set (n=200); use <= 200              (make_private)
    training.batch_size=500 is larger than the training set (n=200); use <= 200     (sparta-train)

So a setting the CLI refuses is refused by the library too, with the same reason and fix. Standard
library only (the config checker imports no TensorFlow).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

from sparta_tf import choices, method_spec


@dataclasses.dataclass(frozen=True)
class Names:
    """How a message names each setting."""

    epochs: str = "epochs"
    batch_size: str = "batch_size"
    physical_batch_size: str = "physical_batch_size"
    jit_compile: str = "jit_compile"
    dataset_size: str = "dataset_size"
    delta: str = "delta"
    noise_multiplier: str = "noise_multiplier"
    engine: str = "engine"
    method: str = "method"
    method_option: str = "{}"
    """A method option's name from its key (``"method.{}"`` in a config)."""


LIBRARY = Names()
"""``make_private``'s keyword arguments."""
CONFIG = Names(epochs="training.epochs", batch_size="training.batch_size",
               physical_batch_size="training.physical_batch_size", jit_compile="training.jit_compile",
               dataset_size="n", delta="privacy.delta", noise_multiplier="privacy.noise_multiplier",
               engine="training.engine", method="method.name", method_option="method.{}")
"""``sparta-train``'s config keys (:mod:`trainers.config`)."""


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def count_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a count of epochs or examples (None: an integer >= 1)."""
    if not _is_integer(value):
        return "must be a whole number >= 1"
    return None if value >= 1 else "must be >= 1"


def physical_batch_size_problem(value: Any) -> str | None:
    """What is wrong with a physical batch size (None: unset, or an integer >= 1)."""
    return None if value is None else count_problem(value)


def jit_compile_problem(value: Any) -> str | None:
    """What is wrong with a ``jit_compile`` setting (None: XLA on, off, or ``"auto"``: on for GPU/TPU, off
    on CPU, :mod:`sparta_tf.xla`)."""
    return None if value is True or value is False or value == "auto" else "must be true, false or auto"


def batch_size_problem(batch_size: Any, dataset_size: int | None = None) -> str | None:
    """What is wrong with an expected batch size ``q n`` (None: a number in ``(0, n]``). A batch larger
    than the training set would make ``q = 1`` silently: every step sees every example."""
    if not _is_number(batch_size) or batch_size <= 0:
        return "must be a number > 0 (the expected Poisson batch size q n)"
    if dataset_size is not None and batch_size > dataset_size:
        return f"is larger than the training set (n={dataset_size}); use <= {dataset_size}"
    return None


def delta_problem(delta: float, dataset_size: int) -> str | None:
    """``delta < 1/n``: a mechanism that publishes one random example of ``n`` in full is
    ``(0, 1/n)``-DP, so a guarantee with ``delta >= 1/n`` can hide the release of an example."""
    if delta < 1.0 / dataset_size:
        return None
    return (f"must be < 1/n = {1.0 / dataset_size:.3g} for n={dataset_size} training examples "
            f"(e.g. {10.0 ** -len(str(dataset_size)):g})")


def _refuse(name: str, value: Any, problem: str | None) -> None:
    if problem:
        raise ValueError(f"{name}={value!r} {problem}")


def check_run(names: Names, *, epochs: Any, batch_size: Any, noise_multiplier: Any, engine: Any,
              physical_batch_size: Any = None, jit_compile: Any = "auto", private: bool = True) -> None:
    """The run's length, batch sizes, given noise multiplier, engine and XLA setting (``private``: whether
    the method is differentially private at all; a private method's ``sigma = 0`` gives no privacy)."""
    _refuse(names.epochs, epochs, count_problem(epochs))
    _refuse(names.batch_size, batch_size, batch_size_problem(batch_size))
    _refuse(names.physical_batch_size, physical_batch_size, physical_batch_size_problem(physical_batch_size))
    _refuse(names.jit_compile, jit_compile, jit_compile_problem(jit_compile))
    if private and noise_multiplier is not None and _is_number(noise_multiplier) and noise_multiplier == 0:
        raise ValueError(f"{names.noise_multiplier}=0 gives no privacy; leave it unset to calibrate it from the "
                         "target epsilon")
    _refuse(names.engine, engine, choices.one_of_problem(engine, choices.ENGINES))


def check_against_data(names: Names, *, dataset_size: Any, batch_size: Any, delta: float) -> None:
    """What needs the training-set size ``n``: an integer ``n >= 1``, a batch of at most ``n`` and
    ``delta < 1/n``."""
    _refuse(names.dataset_size, dataset_size, count_problem(dataset_size))
    _refuse(names.batch_size, batch_size, batch_size_problem(batch_size, int(dataset_size)))
    _refuse(names.delta, delta, delta_problem(delta, int(dataset_size)))


def check_method_run(names: Names, method: str, options: Mapping[str, Any], epochs: int) -> None:
    """A method's resolved ``options`` (every option of its spec, defaults filled in) against a run of
    ``epochs`` epochs: the phases before the sparse one must leave it an epoch, DP-BiTFiT's full
    phase must leave the bias phase one, and ``density = 0`` (which keeps no kernel row) is refused:
    the method would train only biases, norms and head, after spending epsilon on a selection."""
    option = names.method_option.format
    if "warmup_epochs" in options:
        warmup = (method_spec.default_warmup_epochs(epochs) if options["warmup_epochs"] is None
                  else options["warmup_epochs"])
        selection = 1 if options.get("mask") is None else 0
        if warmup + selection >= epochs:
            raise ValueError(
                f"{option('warmup_epochs')}={warmup} must be < {names.epochs} - {selection} (={epochs - selection}): "
                f"the warm-up{' + 1 selection epoch' if selection else ''} must leave a sparse epoch")
    if "full_epochs" in options and options["full_epochs"] >= epochs:
        raise ValueError(f"{option('full_epochs')}={options['full_epochs']} must be < {names.epochs} (={epochs}) "
                         "so that the bias-only phase runs")
    overrides = options.get("density_overrides") or {}
    if options.get("density") == 0 and options.get("mask") is None and not any(v > 0 for v in overrides.values()):
        spends = " after its selection epoch has spent epsilon" if "warmup_epochs" in options else ""
        raise ValueError(f"{option('density')}=0 keeps no kernel row or entry: method {method} would train only the "
                         f"biases, norms and head{spends}; use {names.method}=bitfit for that, or a density in (0, 1]")
