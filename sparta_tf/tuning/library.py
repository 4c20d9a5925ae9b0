"""``tune_privately``: private hyperparameter tuning in one call, following ``make_private``.

::

    result = sparta_tf.tune_privately(
        build_model, x, y, validation_data=(x_val, y_val),
        space={"learning_rate": [0.03, 0.1, 0.3], "density": [0.05, 0.2]},
        target_epsilon=8.0, delta=1e-5, epochs=15, batch_size=256, method="sparta", mean=5)
    result.model          # the best candidate's DP model (its .ledger: the whole tuning's)
    result.hyperparameters, result.score, result.epsilon

A random number of candidates (mean ``mean``, ``shape``: :class:`~sparta_tf.privacy.tuning.CandidateCount`)
each builds a fresh model, draws its values from ``space`` and trains through :func:`make_private` with
the per-run budget that makes the whole procedure meet ``(target_epsilon, delta)``; each is scored by
its noisy count of correct predictions on the validation split; only the best is returned. The
candidates, their number and their scores stay inside the call. It keeps everything in memory: a killed
process loses the tuning (and spent nothing that was released); ``sparta-tune`` is the resumable form.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

import tensorflow as tf

from sparta_tf.methods import make_method
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.tuning import CandidateCount, Repetition
from sparta_tf.private_training import make_private, plan_method, private_model
from sparta_tf.tuning import procedure
from sparta_tf.tuning.space import check_space, corners, names

FIXED = ("epochs", "batch_size", "target_epsilon", "delta", "noise_multiplier", "accountant", "method", "sampling",
         "seed", "dataset_size", "run_dir")
"""``make_private`` arguments a candidate may not change: they set the mechanism every candidate repeats."""


def default_optimizer(learning_rate: float = 0.1, momentum: float = 0.9) -> tf.keras.optimizers.Optimizer:
    """SGD with momentum, the optimizer of the SPARTA paper's vision runs."""
    return tf.keras.optimizers.SGD(learning_rate, momentum=momentum)


@dataclasses.dataclass
class TuningResult:
    """What a private tuning releases: the best candidate's DP ``model`` (None when no candidate ran or
    all diverged), its ``hyperparameters``, its noisy validation accuracy ``score``, and the ``ledger`` of
    the whole procedure (also ``model.ledger``)."""

    model: Any
    hyperparameters: dict | None
    score: float | None
    ledger: PrivacyLedger
    per_run_epsilon: float

    @property
    def epsilon(self) -> float:
        return self.ledger.epsilon()


def tune_privately(
    build_model: Callable[[], tf.keras.Model],
    x: Any,
    y: Any,
    *,
    validation_data: tuple,
    space: Mapping | list,
    target_epsilon: float,
    delta: float,
    epochs: int,
    batch_size: float,
    method: str = "sparta",
    mean: float = 5.0,
    shape: float | str = "geometric",
    optimizer: Callable[..., tf.keras.optimizers.Optimizer] = default_optimizer,
    loss: Any = None,
    metrics: list | None = None,
    score_noise: float | None = None,
    tuning_seed: int | None = None,
    verbose: int = 0,
    **make_private_options: Any,
) -> TuningResult:
    """Tunes ``space`` privately and returns the best candidate (module doc).

    Args:
      build_model: returns a fresh Keras model (e.g. the pre-trained backbone with a new head) per candidate.
      x: the private training split's inputs.
      y: its integer labels (the score compares them with ``argmax`` of the outputs).
      validation_data: ``(x_val, y_val)``, private examples never trained on; the score's split.
      space: names to draw -> a list, ``{"log_uniform": [low, high]}`` or ``{"uniform": [low, high]}``
        (or a list of points, :mod:`sparta_tf.tuning.space`). A name is an argument of ``optimizer``
        (``learning_rate``, ``momentum``) or a :func:`make_private` option (``clip_norm``, ``ema``, the
        method's options such as ``density``); not one of :data:`FIXED`.
      target_epsilon: the epsilon of the whole tuning.
      delta: its delta.
      epochs: epochs of every candidate, as for :func:`make_private`.
      batch_size: every candidate's expected batch size.
      method: every candidate's method.
      mean: the mean number of candidates (:class:`~sparta_tf.privacy.tuning.CandidateCount`).
      shape: that distribution's shape (``"geometric"``, ``"logarithmic"``, ``"poisson"`` or a number >= 0).
      optimizer: builds a candidate's optimizer from its drawn optimizer arguments.
      loss: for ``compile`` (default: sparse categorical cross-entropy on logits).
      metrics: for ``compile``.
      score_noise: std (examples) of the noisy validation count; None: ``sqrt(n_val) / 2``.
      tuning_seed: the secret seed of the draws (None: a fresh one from the OS; a given one becomes a
        caveat in the ledger).
      verbose: ``fit``'s verbosity.
      **make_private_options: every candidate's other :func:`make_private` options.
    """
    x_val, y_val = validation_data
    validation_size = len(y_val)
    procedure.check_validation_size(validation_size)
    space = check_space(space, "space")
    optimizer_names = set(inspect.signature(optimizer).parameters)
    for name in names(space):
        if name in FIXED:
            raise ValueError(f"space.{name} would change the privacy mechanism every candidate repeats: set it as an "
                             "argument of tune_privately instead")
    repetition = Repetition(CandidateCount(mean, shape),
                            float(score_noise or procedure.default_score_noise(validation_size)))
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    n = len(y)

    def split(values: dict) -> tuple[dict, dict, dict]:
        """``values`` and the common options as (optimizer arguments, method options, DP model options)."""
        options = {**make_private_options, **{k: v for k, v in values.items() if k not in optimizer_names}}
        return ({k: v for k, v in values.items() if k in optimizer_names},
                {k: v for k, v in options.items() if not _dp_model_option(k)},
                {k: v for k, v in options.items() if _dp_model_option(k)})

    def method_and_plan(values: dict):
        chosen = make_method(method, **split(values)[1])
        plan = procedure.tuned_plan(lambda tuning: plan_method(
            chosen, dataset_size=n, batch_size=batch_size, epochs=epochs, delta=delta, target_epsilon=target_epsilon,
            tuning=tuning), repetition, target_epsilon, delta)
        return chosen, plan

    _, plan = method_and_plan({})
    procedure.check_signal(plan)
    plan_of = lambda values: method_and_plan(values)[1]
    procedure.check_one_mechanism(plan, plan_of, corners(space), "space")
    draws = procedure.Draws.draw(repetition.count, space, tuning_seed)
    procedure.check_one_mechanism(plan, plan_of, [candidate.values for candidate in draws.candidates], "space")
    tally, best = procedure.Tally(procedure.planned_entries(plan)), None
    for index, candidate in enumerate(draws.candidates):
        optimizer_values, _, dp_options = split(candidate.values)
        chosen, candidate_plan = method_and_plan(candidate.values)
        model = build_model()
        chosen.check(model)
        dp = private_model(model, chosen, candidate_plan, seed=candidate.run_seed, **dp_options)
        dp.compile(optimizer(**optimizer_values), loss=loss, metrics=metrics)
        dp.fit(x, y, verbose=verbose)
        tally.add(procedure.score_candidate(dp, x_val, y_val, draws, index, repetition.score_noise), dp.ledger)
        if tally.best == index:
            best = dp
    ledger = tally.released_ledger(draws, delta=delta, target_epsilon=target_epsilon,
                                   sampling=make_private_options.get("sampling", "poisson"))
    winner = tally.best
    if winner is None:
        return TuningResult(None, None, None, ledger, plan.epsilon)
    best.ledger = ledger
    return TuningResult(best, draws.candidates[winner].values, tally.scores[winner], ledger, plan.epsilon)


def _dp_model_option(name: str) -> bool:
    """Whether a ``make_private`` option belongs to the DP model (not the method's plan)."""
    return name in inspect.signature(make_private).parameters and name != "method_options"
