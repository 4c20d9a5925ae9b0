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

What the result reveals is what the analysis covers, no more: every candidate's model is built with
Keras's automatic-name counters as they were when the call began (:func:`sparta_tf.backend.name_state`),
so the returned model's names do not count the candidates, and the counters are left as one build left
them. Candidates are independent: a ``build_model`` whose models share a variable with an earlier
candidate's (a backbone built once and reused) is refused before the first candidate trains, and so is
a ``run_dir`` (it would make every candidate resume the first). Anything saved or exported from this
process still carries its history (TensorFlow numbers functions process-wide):
:meth:`TuningResult.save_release` writes the release from a fresh process.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

import tensorflow as tf

from sparta_tf import backend
from sparta_tf.methods import make_method
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.user_sampling import dense_user_ids
from sparta_tf.privacy.tuning import CandidateCount, Repetition
from sparta_tf.private_training import make_private, plan_method, private_model
from sparta_tf.tuning import procedure
from sparta_tf.tuning.space import check_space, corners, names

FIXED = ("epochs", "batch_size", "target_epsilon", "delta", "noise_multiplier", "accountant", "method", "sampling",
         "seed", "public_seed", "dataset_size", "run_dir", "bands", "unit")
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

    def save_release(self, directory: str, export_version: int | None = 1,
                     preprocessing: Mapping | None = None) -> str:
        """Writes what the tuning may release to ``directory`` (replaced whole) from a fresh process, so that
        no byte depends on how many candidates ran or which won (:mod:`sparta_tf.tuning.release`):
        ``model.keras``, ``export/<export_version>/`` (None: no export; ``preprocessing``: as for
        :func:`~sparta_tf.export.export_for_serving`), ``results.json`` (values, noisy score, epsilon) and
        ``ledger.json``; returns ``directory``."""
        import os
        import tempfile

        from sparta_tf.tuning.release import write_release

        results = {"released": self.model is not None, "private": self.ledger.is_private,
                   "epsilon": self.epsilon if self.ledger.is_private else None,
                   "target_epsilon": self.ledger.target_epsilon, "delta": self.ledger.delta,
                   "accountant": self.ledger.accountant, "tuning": self.ledger.tuning.to_dict(),
                   "per_run_epsilon": self.per_run_epsilon, "privacy_caveats": self.ledger.caveats()}
        if self.model is None:
            return write_release(directory, results, self.ledger.to_json())
        results |= {"hyperparameters": self.hyperparameters, "validation_score": self.score,
                    "noise_multiplier": self.model.noise_multiplier}
        with tempfile.TemporaryDirectory(prefix=".winner-", dir=os.path.dirname(os.path.abspath(directory))) as tmp:
            path = os.path.join(tmp, "model.keras")
            self.model.model.save(path)
            return write_release(directory, results, self.ledger.to_json(), path, export_version, preprocessing)


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
    public_validation_size: int | None = None,
    tuning_seed: int | None = None,
    verbose: int = 0,
    users: Any = None,
    validation_users: Any = None,
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
      score_noise: std (examples) of the noisy validation count; None: ``sqrt(m) / 2`` with ``m`` the
        public validation size (below), which the released ledger's score entry shows.
      public_validation_size: ``m``, a size fixed without reading the private data (e.g. the expected size of
        your validation split) that the noisy count is divided by and the default noise follows from.
        None: ``n_val``, the size of ``validation_data``, which the released score and ledger then reveal
        (the release records a caveat saying so).
      tuning_seed: the secret seed of the draws (None: a fresh one from the OS; a given one becomes a
        caveat in the ledger).
      verbose: ``fit``'s verbosity.
      users: with ``unit="user"`` (user-level DP), each training example's user id; ``batch_size`` then
        counts users.
      validation_users: with ``unit="user"``, each validation example's user id: the score is then the
        mean over validation users of each one's accuracy (a user moves the count by at most 1).
      **make_private_options: every candidate's other :func:`make_private` options.
    """
    if not (isinstance(validation_data, (tuple, list)) and len(validation_data) == 2):
        raise ValueError(f"validation_data must be (x_val, y_val), private examples never trained on, got "
                         f"{type(validation_data).__name__}: the tuning scores its candidates on them")
    if "run_dir" in make_private_options:
        raise ValueError("run_dir would make every candidate resume the first one's run: tune_privately keeps its "
                         "candidates in memory; for a resumable tuning use sparta-tune")
    if make_private_options.get("mask_dir") is not None:
        raise ValueError("mask_dir would keep one candidate's mask on disk (the last one's, so its count): "
                         "tune_privately keeps its candidates in memory; save the released model's mask instead")
    for name in ("seed", "public_seed"):
        if name in make_private_options:
            raise ValueError(f"{name} would give every candidate one seed: each candidate's seeds come from the "
                             "tuning's; pass tuning_seed to reproduce a tuning")
    x_val, y_val = validation_data
    unit = make_private_options.get("unit", "example")
    check_users_given(unit, users, validation_users)
    validation_size = procedure.validation_units(y_val, validation_users)
    procedure.check_validation_size(validation_size)
    denominator = procedure.public_denominator(public_validation_size, validation_size)
    space = check_space(space, "space")
    optimizer_names = set(inspect.signature(optimizer).parameters)
    for name in names(space):
        if name in FIXED:
            raise ValueError(f"space.{name} would change the privacy mechanism every candidate repeats: set it as an "
                             "argument of tune_privately instead")
    repetition = Repetition(CandidateCount(mean, shape),
                            float(score_noise or procedure.default_score_noise(denominator)))
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    n = len(y) if users is None else dense_user_ids(users)[1]

    def split(values: dict) -> tuple[dict, dict, dict]:
        """``values`` and the common options as (optimizer arguments, method options, DP model options)."""
        # quiet phases (verbose=0): one set of phase lines per candidate would count them
        options = {"verbose": 0, **make_private_options,
                   **{k: v for k, v in values.items() if k not in optimizer_names}}
        return ({k: v for k, v in values.items() if k in optimizer_names},
                {k: v for k, v in options.items() if not _dp_model_option(k) and k not in PLAN_OPTIONS},
                {k: v for k, v in options.items() if _dp_model_option(k)})

    def method_and_plan(values: dict):
        chosen = make_method(method, **split(values)[1])
        plan = procedure.tuned_plan(lambda tuning: plan_method(
            chosen, dataset_size=n, batch_size=batch_size, epochs=epochs, delta=delta, target_epsilon=target_epsilon,
            tuning=tuning, bands=make_private_options.get("bands", 1), unit=unit), repetition, target_epsilon, delta)
        return chosen, plan

    _, plan = method_and_plan({})
    procedure.check_signal(plan)
    plan_of = lambda values: method_and_plan(values)[1]
    procedure.check_one_mechanism(plan, plan_of, corners(space), "space")
    draws = procedure.Draws.draw(repetition.count, space, tuning_seed)
    procedure.check_one_mechanism(plan, plan_of, [candidate.values for candidate in draws.candidates], "space")
    tally, best = procedure.Tally(procedure.planned_entries(plan), plan.unit), None
    if public_validation_size is None:
        tally.record_caveat(procedure.VALIDATION_SIZE_CAVEAT)
    built = _IndependentModels(build_model, backend.name_state())
    for index, candidate in enumerate(draws.candidates):
        optimizer_values, _, dp_options = split(candidate.values)
        chosen, candidate_plan = method_and_plan(candidate.values)
        model = built.next()
        chosen.check(model)
        dp = private_model(model, chosen, candidate_plan, seed=candidate.run_seed,
                           public_seed=draws.public_seed(index), **dp_options)
        dp.compile(optimizer(**optimizer_values), loss=loss, metrics=metrics)
        dp.fit(x, y, verbose=verbose, users=users)
        tally.add(procedure.score_candidate(dp, x_val, y_val, draws, index, repetition.score_noise, validation_users,
                                            denominator), dp.ledger)
        if tally.best == index:
            best = dp
    built.finish()
    ledger = tally.released_ledger(draws, delta=delta, target_epsilon=target_epsilon,
                                   sampling=make_private_options.get("sampling", "poisson"))
    winner = tally.best
    if winner is None:
        return TuningResult(None, None, None, ledger, plan.epsilon)
    best.ledger = ledger
    return TuningResult(best, draws.candidates[winner].values, tally.scores[winner], ledger, plan.epsilon)


PLAN_OPTIONS = ("bands", "unit")
"""``make_private`` options that belong to the privacy plan (the DP model reads them from it), neither the
method's nor the DP model's."""


def _dp_model_option(name: str) -> bool:
    """Whether a ``make_private`` option belongs to the DP model (not the method, nor the plan:
    :data:`PLAN_OPTIONS`)."""
    return name in inspect.signature(make_private).parameters and name not in ("method_options", *PLAN_OPTIONS)


class _IndependentModels:
    """The candidates' models: each built with the name counters of the call's start (no name counts the
    candidates before it), none sharing a variable with an earlier one. The first candidate's model is
    built with a probe beside it, so that a ``build_model`` reusing its layers is refused before anything
    trains."""

    def __init__(self, build_model: Callable[[], tf.keras.Model], names: object):
        self.build_model, self.names = build_model, names
        self.seen: dict[int, str] = {}
        self.first = self._build()
        self.after_one = backend.name_state()
        probe = self._build()
        self._check_shared(probe, self._variables(self.first))
        del probe

    def next(self) -> tf.keras.Model:
        if self.first is not None:
            model, self.first = self.first, None
        else:
            model = self._build()
            self._check_shared(model, self.seen)
        self.seen.update(self._variables(model))
        return model

    def finish(self) -> None:
        """Leaves the name counters as one build left them (whatever number of candidates ran)."""
        backend.restore_name_state(self.after_one)

    def _build(self) -> tf.keras.Model:
        backend.restore_name_state(self.names)
        return self.build_model()

    @staticmethod
    def _variables(model) -> dict[int, str]:
        return {id(backend.tf_variable(v)): backend.variable_key(v) for v in model.weights}

    def _check_shared(self, model, earlier: dict[int, str]) -> None:
        shared = [earlier[key] for key in self._variables(model) if key in earlier]
        if shared:
            raise ValueError(f"build_model returned a model sharing {len(shared)} variable(s) with an earlier "
                             f"candidate's (e.g. {shared[0]}): a candidate would start from another's trained weights "
                             "and the release would depend on every candidate; build every layer inside build_model "
                             "(load the pre-trained backbone there, e.g. from a .keras file)")


def check_users_given(unit: str, users, validation_users) -> None:
    """One line unless user ids come with ``unit="user"`` (for both splits) and only then."""
    given = users is not None or validation_users is not None
    if unit == "example" and given:
        raise ValueError("users= and validation_users= need unit='user' (user-level DP); pass unit='user', or leave "
                         "them out")
    if unit == "user" and (users is None or validation_users is None):
        raise ValueError("unit='user' needs users= (each training example's user id) and validation_users= (each "
                         "validation example's): the training samples users and the score counts them")
