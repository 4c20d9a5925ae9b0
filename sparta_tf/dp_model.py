"""``DPModel``: DP-SGD for any Keras 2 model through plain ``model.fit``.

One call of :meth:`DPModel.train_step` is one DP-SGD step, i.e. one
Poisson-subsampled Gaussian mechanism (Abadi et al. 2016)::

    S_t   = sum_{i in B_t} g_i / max(1, ||g_i||_2 / C)        (per-example clipping)
    g~_t  = (S_t + N(0, sigma^2 C^2 I)) / (q n)               (noise, expected batch size)
    theta <- optimizer(theta, g~_t)                           (trainable coordinates only)

* ``g_i`` is restricted to the trainable set (:attr:`DPModel.trainable_set`,
  whole variables, rows of kernels or entries; see :mod:`sparta_tf.trainable`):
  per-example gradients, norms, clipping, noise and optimizer state cover
  exactly those coordinates (in their compact form); every other coordinate
  is never written by the :class:`~sparta_tf.optim.MaskedOptimizer` and stays
  bit-identical.
* During a selection epoch (:meth:`DPModel.begin_scoring`) a step does not
  update weights: it releases one noisy mask statistic instead (see
  :mod:`sparta_tf.selection.scoring`), the same Gaussian mechanism.
* A batch element is ``(x, y, sample_weight)`` of length ``k * P`` (see
  :mod:`sparta_tf.privacy.sampling`): it is processed as ``k`` micro-batches
  of the physical batch size ``P`` whose clipped sums are accumulated before
  the single noisy update. ``sample_weight`` is a 0/1 padding mask, not a
  weighting: examples with ``w_i = 0`` are padding and contribute exactly
  zero, examples with ``w_i = 1`` contribute ``clip(g_i)``; any other value
  is refused (a weight ``w_i > 1`` would scale an example's contribution
  past the clip bound).
* Before the first step, :func:`sparta_tf.model_checks.probe_batch_mixing`
  checks on a few real examples that the model's training-mode forward pass
  keeps examples separate (BatchNorm variants are already refused by class
  at construction).
* Under ``tf.distribute`` the clipped sums are all-reduced across replicas
  and the noise, drawn from a key shared by all replicas
  (:mod:`sparta_tf.noise`), is added once to the global sum. Under
  ``MultiWorkerMirroredStrategy`` every worker draws the same global Poisson
  sample from the chief's seed and trains on its share
  (:mod:`sparta_tf.distribute`).
* Tracing a step turns TensorFloat-32 off for the process
  (:mod:`sparta_tf.precision`): the clip bound's rounding margin assumes IEEE
  float32 matmuls.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from sparta_tf.losses import per_example_loss_fn
from sparta_tf import distribute, keras_trainer, random_streams
from sparta_tf.masks import is_mask_charge
from sparta_tf.model_checks import PROBE_EXAMPLES, probe_batch_mixing, reject_batch_mixing_layers
from sparta_tf.noise import gaussian_noise
from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.per_example import make_engine
from sparta_tf.per_example.bookkeeping import BookkeepingEngine, clipped_batch, make_clipping_engine
from sparta_tf.per_example.coverage import check_coverage
from sparta_tf.precision import accumulation_dtype, require_ieee_float32_matmuls
from sparta_tf.privacy.accounting import check_delta_for_dataset, check_noise_multiplier, check_sample_rate
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.sampling import (
    PoissonSampler,
    default_physical_batch_size,
    poisson_provenance,
    shuffled_dataset,
    shuffled_steps_per_epoch,
)
from sparta_tf.trainable import TrainableSet
from sparta_tf.xla import JitCompile, resolve_jit_compile

SAMPLING_MODES = ("poisson", "shuffle")


def _check_positive(name: str, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return value


class DPModel(tf.keras.Model):
    """Wraps a Keras model so that ``fit`` trains it with DP-SGD.

    Args:
      model: any Keras 2 model (Sequential, functional or subclassed) without
        BatchNormalization in training mode.
      noise_multiplier: ``sigma``; the noise std on each trainable coordinate
        of the summed clipped gradient is ``sigma * clip_norm``.
      clip_norm: ``C``, the per-example L2 bound.
      sample_rate: Poisson rate ``q``. When ``fit`` gets arrays and
        ``sampling="shuffle"``, ``q`` is only used as ``batch = round(q n)``.
      dataset_size: ``n``; taken from the arrays given to ``fit`` when omitted.
      physical_batch_size: micro-batch size ``P`` processed at once; default
        ``qn + 4`` standard deviations (see ``default_physical_batch_size``).
      sampling: ``"poisson"`` (what the accountant assumes) or ``"shuffle"``
        (fixed-size shuffled batches; the privacy report says the accountant
        does not cover it).
      delta: when given, a :class:`PrivacyLedger` records every step and
        ``fit`` logs ``epsilon``; with ``target_epsilon`` training refuses to
        start (or stops, after ``on_budget_exhausted``) rather than overspend.
      seed: the run seed from which the sampling and noise streams are derived
        (:mod:`sparta_tf.random_streams`; tests, reproducibility, resume).
        ``None``: a secret seed from the OS.
      engine: how the clipped sum is computed: ``"auto"`` (book-keeping, without
        per-example gradients, wherever every trainable variable is owned by a
        leaf layer; see :mod:`sparta_tf.per_example.bookkeeping`), ``"bookkeeping"``,
        or the materialising references ``"layerwise"`` / ``"vectorized"``
        (selection epochs always use a materialising engine).
      jit_compile: ``"auto"`` (XLA on GPU/TPU, off on CPU), True or False.
    """

    def __init__(
        self,
        model: tf.keras.Model,
        *,
        noise_multiplier: float,
        clip_norm: float = 1.0,
        sample_rate: float,
        dataset_size: int | None = None,
        physical_batch_size: int | None = None,
        sampling: str = "poisson",
        delta: float | None = None,
        target_epsilon: float | None = None,
        accountant: str = "pld",
        seed: int | None = None,
        engine: str = "auto",
        jit_compile: JitCompile = "auto",
        name: str | None = None,
    ):
        super().__init__(name=name or f"dp_{model.name}")
        reject_batch_mixing_layers(model)
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling={sampling!r} is not one of {SAMPLING_MODES}")
        self.model = model
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.clip_norm = _check_positive("clip_norm", clip_norm)
        self.sample_rate = check_sample_rate(sample_rate)
        self.dataset_size = dataset_size
        self.physical_batch_size = physical_batch_size
        self.sampling = sampling
        self.engine_name = engine
        self._jit_compile_setting = jit_compile
        seed = distribute.agree_on_seed(tf.distribute.get_strategy(), seed)
        self._seed = seed
        self.dp_step = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="dp_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self._noise_seed = tf.Variable(seed, dtype=tf.int64, trainable=False, name="noise_seed")
        self.ledger = (
            PrivacyLedger(delta, accountant=accountant, target_epsilon=target_epsilon, sampling=sampling)
            if delta is not None else None
        )
        if dataset_size is not None and self.ledger is not None:
            check_delta_for_dataset(self.ledger.delta, dataset_size)
        self._trainable_set: TrainableSet | None = None
        self._masked_optimizer: MaskedOptimizer | None = None
        self._scorer = None
        self.privacy_callback: PrivacyCallback | None = None
        self._engine = None
        self._per_example_loss = None
        self._loss_tracker = tf.keras.metrics.Mean(name="loss")
        self._model_probed = False
        self.private_run = None  # set by sparta_tf.make_private

    # ------------------------------------------------------------------ model

    def attach_run(self, run) -> None:
        """Makes ``fit`` run ``run``'s method and plan (:class:`sparta_tf.private_training.PrivateRun`)."""
        self.private_run = run

    @property
    def plan(self):
        """The run's :class:`~sparta_tf.privacy.plan.PrivacyPlan` (models from ``make_private``), else None."""
        return None if self.private_run is None else self.private_run.plan

    @property
    def method(self):
        """The :class:`~sparta_tf.methods.Method` ``fit`` runs (models from ``make_private``), else None."""
        return None if self.private_run is None else self.private_run.method

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def seed(self) -> int:
        """The run seed of every random stream (:mod:`sparta_tf.random_streams`). Secret: whoever
        knows it can recompute the noise and the batches; store it only with private checkpoints."""
        return self._seed

    def checkpoint_state(self) -> dict[str, tf.Module]:
        """What a resumable checkpoint must hold: weights, optimizer state, step counters, seed.

        ``{"model", "dp_step", "noise_seed", "iterations", "masked_optimizer"}``
        (``masked_optimizer`` only after ``compile``), for ``tf.train.Checkpoint``. The privacy
        ledger is not a ``tf.Module``: save ``ledger.to_json()`` beside the checkpoint and restore it
        (``PrivacyLedger.from_json``) with it; ``fit`` refuses a ``dp_step`` its ledger does not cover.
        """
        state = {"model": self.model, "dp_step": self.dp_step, "noise_seed": self._noise_seed}
        if self._masked_optimizer is not None:
            state["iterations"] = self.optimizer.iterations
            state["masked_optimizer"] = self._masked_optimizer
        return state

    @property
    def trainable_set(self) -> TrainableSet:
        """The coordinates DP-SGD clips, noises and updates (default: every trainable variable)."""
        if self._trainable_set is None:
            self._trainable_set = TrainableSet.of_variables(self.model.trainable_variables)
        return self._trainable_set

    @property
    def dp_variables(self) -> list[tf.Variable]:
        """The variables of the trainable set (some may be trained only in part)."""
        return self.trainable_set.variables

    def set_dp_variables(self, variables: Sequence[tf.Variable]) -> None:
        """Restricts DP-SGD to whole ``variables`` (e.g. biases + head for a warm-up phase)."""
        if not variables:
            raise ValueError("the trainable set is empty: pass at least one variable")
        self.set_trainable_set(TrainableSet.of_variables(variables))

    def set_trainable_set(self, trainable_set: TrainableSet) -> None:
        """Restricts DP-SGD to ``trainable_set``; usable between epochs of a running ``fit``."""
        known = {id(v) for v in self.model.trainable_variables}
        unknown = [v.name for v in trainable_set.variables if id(v) not in known]
        if unknown:
            raise ValueError(f"not trainable variables of the wrapped model: {unknown[:3]}")
        self._trainable_set = trainable_set
        self._engine = None
        if self._masked_optimizer is not None:
            with self.distribute_strategy.scope():
                self._masked_optimizer.build(trainable_set)
        self._retrace()

    def begin_scoring(self, scorer) -> None:
        """From the next step on, steps release mask scores to ``scorer`` instead of updating weights.
        A scorer that is not private (``score="oracle"``: unclipped, noiseless) marks the ledger."""
        if not scorer.private and self.ledger is not None:
            self.ledger.record_nonprivate(f"selection scores {scorer.score!r}: unclipped, noiseless gradients")
        self._scorer = scorer
        self._engine = None
        self._retrace()

    def end_scoring(self) -> None:
        """Back to DP-SGD updates of the trainable set."""
        self._scorer = None
        self._engine = None
        self._retrace()

    def _retrace(self) -> None:
        """Drops the traced step; rebuilds it at once inside a running ``fit``."""
        keras_trainer.retrace(self)

    @property
    def metrics(self):
        """The mean per-example loss over real examples, then the compiled metrics."""
        return [self._loss_tracker] + keras_trainer.compiled_metrics(self)

    def _update_metrics(self, y, predictions, losses, weights):
        self._loss_tracker.update_state(losses, sample_weight=weights)
        keras_trainer.update_compiled_metrics(self, y, predictions, weights)

    def test_step(self, data):
        x, y, weights = tf.keras.utils.unpack_x_y_sample_weight(data)
        predictions = self(x, training=False)
        self._update_metrics(y, predictions, self._per_example_loss(y, predictions), weights)
        return self.get_metrics_result()

    # ---------------------------------------------------------------- compile

    def compile(self, optimizer="sgd", loss=None, metrics=None, jit_compile=None, **kwargs):
        """Like ``keras.Model.compile``; ``loss`` must be per-example (any built-in is).

        ``metrics`` are compiled as Keras *weighted* metrics: the padding rows of
        a Poisson batch have weight 0, and Keras passes sample weights only to
        weighted metrics, so plain ones would count padding as examples.
        """
        self._per_example_loss = per_example_loss_fn(loss)
        if jit_compile is not None:
            self._jit_compile_setting = jit_compile
        weighted = _all_weighted(metrics, kwargs.pop("weighted_metrics", None))
        super().compile(
            optimizer=optimizer, loss=loss, weighted_metrics=weighted,
            jit_compile=resolve_jit_compile(self._jit_compile_setting), **kwargs,
        )
        self._masked_optimizer = MaskedOptimizer(self.optimizer)
        with self.distribute_strategy.scope():
            self._masked_optimizer.build(self.trainable_set)

    # ------------------------------------------------------------- train step

    def _step_selections(self):
        """What per-example gradients are needed for: the scorer's kernels or the trainable set."""
        return self._scorer.selections if self._scorer is not None else self.trainable_set.selections

    def engine_cost_table(self) -> list:
        """Per selected variable, how the book-keeping engine computes its per-example norms
        (``NormMethod``: method and the cost model's numbers) in the last traced step; empty
        before the first step or with a materialising engine."""
        return self._engine.cost_table() if isinstance(self._engine, BookkeepingEngine) else []

    def _needs_per_example_gradients(self) -> bool:
        """True when the step uses per-example gradients themselves, not only clipped sums."""
        return self._scorer is not None and not self._scorer.bookkeeping_statistic

    def _get_engine(self):
        """Book-keeping by default for DP steps and selection statistics (see
        :mod:`sparta_tf.per_example.bookkeeping`); a materialising engine where the step needs
        per-example gradients themselves (entry-wise ``sum_abs`` scores, DP-SSGD's dropping)."""
        if self._engine is None:
            if self._needs_per_example_gradients():
                name = "auto" if self.engine_name == "bookkeeping" else self.engine_name
                self._engine = make_engine(self.model, self._step_selections(), name)
            else:
                self._engine = make_clipping_engine(self.model, self._step_selections(), self.engine_name)
        return self._engine

    def _micro_batch_size(self) -> int | None:
        if self.physical_batch_size is None:
            return None
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if self.physical_batch_size % replicas:
            raise ValueError(
                f"physical_batch_size={self.physical_batch_size} is not divisible by the "
                f"{replicas} replicas; use a multiple of {replicas}"
            )
        return self.physical_batch_size // replicas

    def _micro_batch_sum(self, x, y, weights):
        valid = weights > 0
        engine = self._get_engine()
        if self._scorer is not None and isinstance(engine, BookkeepingEngine):
            sums, losses, predictions = self._scorer.batch_statistic_bookkeeping(
                engine, x, y, self._per_example_loss, valid)
            self._update_metrics(y, predictions, losses, weights)
            return sums
        if self._scorer is not None:
            result = engine(x, y, self._per_example_loss, valid)
            sums = self._scorer.batch_statistic(result.grads, result.valid)
        else:
            result = clipped_batch(engine, x, y, self._per_example_loss, valid, self.clip_norm)
            sums = result.sums
        self._update_metrics(y, result.predictions, result.losses, weights)
        return sums

    def _clipped_sum(self, x, y, weights):
        """Sum over all micro-batches of the element of the clipped per-example gradients
        (or, while scoring, of the scorer's batch statistic)."""
        micro = self._micro_batch_size()
        if micro is None:
            return self._micro_batch_sum(x, y, weights)
        total = tf.shape(weights)[0]
        tf.debugging.assert_equal(
            total % micro, 0,
            message="batch length is not a multiple of the physical batch size; feed "
            "batches from sparta_tf.privacy.PoissonSampler with the same physical_batch_size",
        )

        def micro_batch(t, i):
            return tf.reshape(t, tf.concat([[-1, micro], tf.shape(t)[1:]], 0))[i]

        def body(i, sums):
            part = tf.nest.map_structure(lambda t: micro_batch(t, i), (x, y, weights))
            new = self._micro_batch_sum(*part)
            return i + 1, [a + b for a, b in zip(sums, new)]

        zeros = [tf.zeros(s.shape, s.dtype) for s in self._statistic_specs()]
        _, sums = tf.while_loop(lambda i, _: i < total // micro, body, (tf.constant(0), zeros))
        return sums

    def _statistic_specs(self) -> list[tf.TensorSpec]:
        """Shapes of the per-step sums: compact gradients, or the scorer's statistics."""
        if self._scorer is not None:
            return [tf.TensorSpec(shape, tf.float32) for shape in self._scorer.statistic_shapes()]
        return [tf.TensorSpec(s.compact_shape, accumulation_dtype(s.variable.dtype)) for s in self.trainable_set]

    def _noisy_mean(self, sums):
        """``(S + N(0, sigma^2 C^2)) / (q n)``, identical on every replica; the noise is drawn in the
        dtype of the sums (float32, float64 for a float64 model), before any cast to a variable's dtype."""
        if self.dataset_size is None:
            raise ValueError("dataset_size is unknown: pass DPModel(dataset_size=n) or fit arrays")
        std = self.noise_multiplier * self.clip_norm
        noise = gaussian_noise([s.shape for s in sums], std, self._noise_seed, self.dp_step,
                               dtype=[s.dtype for s in sums])
        expected_batch = self.sample_rate * self.dataset_size
        return [(s + z) / expected_batch for s, z in zip(sums, noise)]

    def train_step(self, data):
        require_ieee_float32_matmuls()
        if self.model.losses:
            raise ValueError(
                "the model has regularization losses, which DP-SGD would leave unclipped; "
                "remove kernel/activity regularizers and use the optimizer's weight_decay"
            )
        x, y, weights = tf.keras.utils.unpack_x_y_sample_weight(data)
        if weights is None:
            weights = tf.ones(tf.shape(tf.nest.flatten(x)[0])[:1], tf.float32)
        sums = self._clipped_sum(x, y, weights)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
        if self._scorer is not None:
            self._scorer.release(sums, self._noise_seed, self.dp_step)
        else:
            self._masked_optimizer.apply(self._noisy_mean(sums))
        self.dp_step.assign_add(1)
        return self.get_metrics_result()

    # -------------------------------------------------------------------- fit

    def _input_pipeline(self, x, y, initial_step: int):
        """(dataset, steps_per_epoch) for in-memory arrays, Poisson or shuffled."""
        n = len(tf.nest.flatten(x)[0])
        if self.dataset_size is None:
            if self.ledger is not None:
                check_delta_for_dataset(self.ledger.delta, n)
            self.dataset_size = n
        elif self.dataset_size != n:
            raise ValueError(f"dataset_size={self.dataset_size} but fit got {n} examples; they must agree")
        if self.sampling == "shuffle":
            batch = max(1, round(self.sample_rate * n))
            dataset = shuffled_dataset(x, y, batch, seed=self._seed, start_step=initial_step)
            return dataset, shuffled_steps_per_epoch(n, batch)
        replicas = self.distribute_strategy.num_replicas_in_sync
        if self.physical_batch_size is None:
            self.physical_batch_size = default_physical_batch_size(n, self.sample_rate, multiple_of=replicas)
        sampler = PoissonSampler(n, self.sample_rate, self.physical_batch_size, seed=self._seed)
        return sampler.dataset(x, y, start_step=initial_step), sampler.steps_per_epoch

    def _check_dataset_provenance(self, dataset: tf.data.Dataset) -> None:
        """Records a ledger caveat unless ``dataset`` is, unchanged, what ``PoissonSampler(n, q)
        .dataset`` made for this model's ``n`` and ``q``: the ledger charges Poisson sampling at
        ``q``, which a hand-made or transformed dataset (fixed batches, another rate) need not be."""
        if self.ledger is None or not self.ledger.covered_by_accountant:
            return  # no accounting, or the ledger already says its sampling is not Poisson
        made = poisson_provenance(dataset)
        expected = (self.dataset_size, self.sample_rate)
        if made is not None and made[1] == self.sample_rate and self.dataset_size in (None, made[0]):
            return
        what = ("a tf.data.Dataset that PoissonSampler did not make (or one transformed after it)" if made is None
                else f"the dataset of PoissonSampler(n={made[0]}, sample_rate={made[1]:g})")
        self.ledger.record_caveat(
            f"fit got {what}, but the ledger charges Poisson sampling of "
            f"{'the' if expected[0] is None else f'n={expected[0]}'} examples at "
            f"q={expected[1]:g}; the guarantee holds only if its batches are exactly that; feed arrays to fit, "
            "or PoissonSampler(n, q, ...).dataset(x, y) unchanged")

    def _build_compiled_metrics(self, x, y) -> None:
        """Creates the compiled metrics (and their variables) eagerly, before the step is traced.

        Keras builds them inside the first call of the traced step; a
        ``tf.function`` whose first trace creates variables is traced a second
        time, which for a DP step (per-example gradients, micro-batch loop) costs
        seconds per phase. Built from the model's output on a few real examples
        ``x`` (shapes that the data has, so any valid model runs) and their
        labels ``y``; no metric state is updated.
        """
        if y is None:
            return
        with self.distribute_strategy.scope():
            keras_trainer.build_compiled_metrics(self, lambda: self.model(x, training=False), y)

    def _probe_model(self, x, y) -> None:
        """Before the first DP step, on a few real examples ``x, y`` (no padding), once per model:
        :func:`probe_batch_mixing` (training mode keeps examples apart) and
        :func:`~sparta_tf.per_example.coverage.check_coverage` (every trainable variable is seen,
        exactly, by the engine's per-example rules). Both refuse the model with one line."""
        if self._model_probed:
            return
        everything = TrainableSet.of_variables(self.model.trainable_variables)
        engine = make_clipping_engine(self.model, everything, self.engine_name)  # refuses what it cannot plan
        probe_batch_mixing(self.model, x)
        if self._per_example_loss is not None:
            check_coverage(engine, x, y, self._per_example_loss, self.distribute_strategy)
        self._model_probed = True

    def _first_examples(self, dataset: tf.data.Dataset):
        """``(x, y)``: the real examples (weight 1) of ``dataset``'s first element."""
        x, y, weights = tf.keras.utils.unpack_x_y_sample_weight(next(iter(dataset.take(1))))
        if weights is None:
            return x, y
        rows = tf.where(tf.reshape(weights, [-1]) > 0)[:, 0]
        pick = lambda t: tf.gather(t, rows)  # noqa: E731
        return tf.nest.map_structure(pick, x), (None if y is None else tf.nest.map_structure(pick, y))

    def _privacy_callback(self, callbacks, steps_per_epoch, on_budget_exhausted):
        """The caller's :class:`PrivacyCallback`, else this model's own, one for every ``fit``.

        One callback for the model's life: it counts ``dp_step`` from its last record, so the
        steps of a ``fit`` that ended in an exception (no ``on_epoch_end`` / ``on_train_end``)
        are recorded when the next ``fit`` begins, with the values in force when they ran.
        """
        existing = [c for c in callbacks if isinstance(c, PrivacyCallback)]
        if existing or self.ledger is None:
            if existing:
                self._check_caller_callback(existing[0])
                self._check_ledger_covers_dp_step(existing[0])
            return existing[0] if existing else None
        own = self.privacy_callback
        budget_mode = "strict" if self.private_run is None else self.private_run.budget_mode
        if own is None or own.ledger is not self.ledger or own.step_counter is not self.dp_step:
            own = PrivacyCallback(
                self.ledger, self.noise_multiplier, self.sample_rate, steps_per_epoch,
                step_counter=self.dp_step, on_budget_exhausted=on_budget_exhausted, budget_mode=budget_mode,
            )
        else:
            own.flush()  # an interrupted fit's steps, under the values they ran with
            own.noise_multiplier, own.sample_rate = self.noise_multiplier, self.sample_rate
            own.steps_per_epoch = steps_per_epoch
            own.on_budget_exhausted = on_budget_exhausted
            own.budget_mode = budget_mode
        self._check_ledger_covers_dp_step(own)
        return own

    def _check_caller_callback(self, callback: PrivacyCallback) -> None:
        """A caller's :class:`PrivacyCallback` records what this model's steps run with: the same
        ``sigma`` and ``q`` (and the model's step counter), or epsilon would describe another mechanism."""
        problems = []
        if not math.isclose(callback.noise_multiplier, self.noise_multiplier, rel_tol=1e-12):
            problems.append(f"noise_multiplier {callback.noise_multiplier:g} (the model's: {self.noise_multiplier:g})")
        if not math.isclose(callback.sample_rate, self.sample_rate, rel_tol=1e-12):
            problems.append(f"sample_rate {callback.sample_rate:g} (the model's: {self.sample_rate:g})")
        if callback.step_counter is not None and callback.step_counter is not self.dp_step:
            problems.append("a step_counter other than the model's dp_step")
        if problems:
            raise ValueError(f"the PrivacyCallback passed to fit records {' and '.join(problems)}; leave it out "
                             "(the model charges its own ledger from the values it runs with) or make it agree")

    def _check_ledger_covers_dp_step(self, callback: PrivacyCallback) -> None:
        """``dp_step`` counts every DP step this model's weights have been through; the ledger must
        hold at least as many (recorded or pending), or epsilon would leave steps out: e.g. after
        ``checkpoint_state()`` was restored into a new DPModel whose ledger starts empty."""
        if callback.ledger is not self.ledger or callback.step_counter is not self.dp_step:
            return
        recorded = sum(entry.count for entry in self.ledger.entries
                       if entry.kind == callback.kind and not is_mask_charge(entry))
        ran = int(self.dp_step.numpy())
        if recorded + callback.pending_steps() < ran:
            raise ValueError(
                f"dp_step is {ran} but the privacy ledger records {recorded} DP steps: restore the ledger "
                "saved with the checkpoint (dp_model.ledger = PrivacyLedger.from_json(...)) before fit, "
                "or epsilon would leave the other steps out"
            )

    def fit(
        self,
        x=None,
        y=None,
        epochs: int | None = None,
        verbose="auto",
        callbacks=None,
        steps_per_epoch: int | None = None,
        on_budget_exhausted=None,
        initial_epoch: int = 0,
        **kwargs,
    ):
        """``keras.Model.fit`` with DP input and privacy bookkeeping.

        Arrays ``x, y`` are fed as Poisson samples (or shuffled batches when
        ``sampling="shuffle"``) with ``round(1/q)`` steps per epoch; a
        ``tf.data.Dataset`` is used as given (it must come from
        :class:`sparta_tf.privacy.PoissonSampler` for the accounting to hold).
        When the model has a ledger, ``epsilon`` is logged every epoch.

        ``epochs``: default 1, or for a model from :func:`sparta_tf.make_private` the planned
        epochs, whose ``fit`` also runs the method's phases (and with ``run_dir`` resumes a killed run;
        see :mod:`sparta_tf.private_training`).
        """
        callbacks = list(callbacks or [])
        if self.private_run is not None:
            epochs, initial_epoch, callbacks = self.private_run.before_fit(
                self, x, y, epochs, initial_epoch, callbacks)
        elif epochs is None:
            epochs = 1
        if x is not None and not isinstance(x, tf.data.Dataset):
            if y is None:
                raise ValueError("fit(x, y): labels y are required with array inputs")
            first = _first_rows(x), _first_rows(y)
            x, steps_per_epoch = self._input_pipeline(x, y, int(self.dp_step.numpy()))
            y = None
        elif isinstance(x, tf.data.Dataset):
            self._check_dataset_provenance(x)
            x = x.map(_checked_padding_mask)
            first = self._first_examples(x)
        if isinstance(x, tf.data.Dataset):
            self._probe_model(*first)
            self._build_compiled_metrics(*first)
            x = distribute.for_fit(x, self.distribute_strategy)
        privacy = self._privacy_callback(callbacks, steps_per_epoch, on_budget_exhausted)
        if privacy is not None and privacy not in callbacks:
            callbacks.insert(0, privacy)
        self.privacy_callback = privacy
        if verbose != 0 and not any(isinstance(c, tf.keras.callbacks.ProgbarLogger) for c in callbacks):
            # After the privacy callback, so that the progbar shows epsilon.
            callbacks.append(keras_trainer.step_progress_bar())
        return super().fit(
            x, y, epochs=epochs, verbose=verbose, callbacks=callbacks,
            steps_per_epoch=steps_per_epoch, initial_epoch=initial_epoch, **kwargs,
        )


def _first_rows(t, rows: int = PROBE_EXAMPLES):
    """The first ``rows`` examples of arrays or tensors (any structure)."""
    return tf.nest.map_structure(lambda a: tf.convert_to_tensor(a[:rows]), t)


def _checked_padding_mask(*element):
    """A dataset element ``(x, y, w)`` whose ``w`` is refused unless every weight is 0 or 1."""
    x, y, weights = tf.keras.utils.unpack_x_y_sample_weight(element)
    if weights is None:
        return element
    weights = tf.convert_to_tensor(weights)
    tf.debugging.assert_equal(
        tf.reduce_all(tf.logical_or(tf.equal(weights, 0), tf.equal(weights, 1))), True,
        message="DPModel: sample_weight is the 0/1 padding mask of Poisson batches, not a weighting; "
        "weights other than 0 and 1 would change an example's clipped contribution",
    )
    return x, y, weights


def _all_weighted(metrics, weighted_metrics):
    """``metrics`` and ``weighted_metrics`` of ``compile`` as one weighted list (see ``DPModel.compile``)."""
    if metrics is None or weighted_metrics is None:
        return weighted_metrics if metrics is None else metrics
    if isinstance(metrics, (list, tuple)) and isinstance(weighted_metrics, (list, tuple)):
        return list(metrics) + list(weighted_metrics)
    raise ValueError("DPModel.compile weighs every metric by the padding mask: pass per-output metrics "
                     "in one argument, `metrics` or `weighted_metrics`, not both")
