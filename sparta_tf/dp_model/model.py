"""``DPModel``: DP-SGD for any Keras model through plain ``model.fit``.

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
* Before the first step, :func:`sparta_tf.model_checks.probe_batch_mixing` checks on a few
  real examples that training mode keeps examples separate (BatchNorm is refused by class).
* Under ``tf.distribute`` the clipped sums are all-reduced across replicas and the noise,
  drawn from a key shared by all replicas (:mod:`sparta_tf.dp_step.noise`), is added once;
  on several workers every worker draws the chief's global Poisson sample and trains on its
  share (:mod:`sparta_tf.distribute`).
* Tracing a step turns TensorFloat-32 off (:mod:`sparta_tf.precision`): the clip bound's
  rounding margin assumes IEEE float32 matmuls.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import tensorflow as tf

from sparta_tf import distribute, keras_trainer, random_streams
from sparta_tf.choices import ENGINES, SAMPLING_MODES, memory_bytes, one_of_problem
from sparta_tf.dp_model import fit_inputs, training_logs
from sparta_tf.dp_model.wrapped_saving import WrappedModelSaving
from sparta_tf.dp_step import KEEP_ALL, GradientFilter, GradientRelease, MicroBatches, Release, ScoreRelease, StepParts
from sparta_tf.dp_step.correlated_noise import CorrelatedNoise
from sparta_tf.dp_step.usable_examples import METRIC_NAME as NON_FINITE, NonFiniteExamples
from sparta_tf.dp_step.user_units import UserUnits, check_user_level
from sparta_tf.dp_step.views import AugmentationMultiplicity, check_multiplicity
from sparta_tf.privacy.user_sampling import DEFAULT_EXAMPLES_PER_USER
from sparta_tf.losses import per_example_loss_fn
from sparta_tf.model_checks import adapted_state_caveat, reject_batch_mixing_layers, reject_unscopable_name
from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.optim.weight_average import AveragedWeights, WeightAverage, check_decay
from sparta_tf.per_example import BookkeepingEngine, make_engine
from sparta_tf.per_example.memory_budget import step_budget
from sparta_tf.precision import require_ieee_float32_matmuls
from sparta_tf.privacy import charging
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.layout import PlainStepsGuard, SamplingLayout
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.trainable import TrainableSet
from sparta_tf.xla import JitCompile, resolve_jit_compile



class DPModel(WrappedModelSaving, tf.keras.Model):
    """Wraps a Keras model so that ``fit`` trains it with DP-SGD.

    Args:
      model: any Keras model (Sequential, functional or subclassed) without
        BatchNormalization in training mode.

    ``noise_multiplier``, ``clip_norm``, ``sample_rate``, ``dataset_size`` and ``delta`` build the
    model's one :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism` (:attr:`mechanism`), once:
    the step's noise and normalisation, the sampler, the selection scorer and the ledger's charge
    all read that object (the read-only attributes of the same names are views of it).

    Args:
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
      public_seed: the seed of the public streams (random masks and pre-pruning, gradient
        dropping, augmentation), whose draws may be read off a release. ``None``: ``seed``
        when given, else a second seed from the OS, independent of the secret one.
      engine: how the clipped sum is computed: ``"auto"`` (book-keeping where every trainable
        variable has a leaf layer, :mod:`sparta_tf.per_example.bookkeeping`), ``"bookkeeping"``,
        or the materialising ``"layerwise"`` / ``"vectorized"`` (always in selection epochs).
      max_memory: the bytes of layer output gradients the book-keeping engine's one-pass step
        may keep (an int, or a string such as ``"2GiB"``); a step that would keep more runs in two
        passes, keeping none for one more backward pass (:mod:`sparta_tf.per_example.streaming`).
        None (default): a quarter of the GPU's memory, else of the host's available memory
        (:mod:`sparta_tf.per_example.memory_budget`); :meth:`engine_memory_plan` says what a step chose.
        With ``bands > 1`` the buffered correlated noise counts against it.
      jit_compile: ``"auto"`` (XLA on GPU/TPU, off on CPU), True or False.
      augmult: ``K``, augmented views per example (augmentation multiplicity, De et al. 2022;
        :mod:`sparta_tf.dp_step.views`): each example's gradient is the mean over its ``K`` views,
        then clipped once, so the privacy analysis is that of ``K = 1``; a micro-batch of ``P``
        examples runs ``K P`` rows. 1 (the default): each example as is.
      augmentation: how a view is drawn (:mod:`sparta_tf.data.view_augmentation`): None (random
        flip + pad-and-crop of images, when ``augmult > 1``), ``{"flip": bool, "pad": int}`` for the
        default's options, a Keras layer, or a function ``fn(x, seed)`` of one example. Given with
        ``augmult=1``: one augmented view per example.
      ema: a decay in (0, 1) (e.g. 0.999): an exponential moving average of the weights follows every
        DP-SGD update on the trainable set (:attr:`weight_average`,
        :mod:`sparta_tf.optim.weight_average`; post-processing, no privacy cost). None (default): none.
      use_ema_weights: with ``ema``, validation during ``fit`` evaluates the averaged weights and after
        ``fit`` the model holds them (``evaluate``, ``save``, export); False: the model keeps the raw
        weights. Default True.
      bands: ``b``, BandMF's correlated noise (Choquette-Choo et al. 2023; :mod:`sparta_tf.privacy.banded`,
        :mod:`sparta_tf.dp_step.correlated_noise`): the noise of step ``t`` is ``C^{-1} z`` for the banded
        square root ``C`` of the training's workload (SGD with the optimizer's momentum), and the batches
        are cyclic Poisson samples (step ``t`` samples group ``t mod b`` at ``b q``), charged as
        ``ceil(T / b)`` steps at ``b q``. Needs ``b q <= 1`` and Poisson sampling; keeps ``b - 1`` noise
        tensors of the trainable coordinates. 1 (the default): independent noise, DP-SGD.
      unit: what one guarantee protects: ``"example"`` (the default), or ``"user"`` (user-level DP,
        :mod:`sparta_tf.dp_step.user_units`): ``fit(x, y, users=ids)`` samples users at rate ``q``,
        each sampled user brings at most ``examples_per_user`` of its examples, and the user's mean
        gradient is clipped to ``C`` as one unit; ``dataset_size``, the expected batch ``q n`` and
        ``physical_batch_size`` then count users, and the ledger's epsilon is per user.
      examples_per_user: ``k``, the most examples of one user in a step (``unit="user"`` only). None:
        8 (:data:`~sparta_tf.privacy.user_sampling.DEFAULT_EXAMPLES_PER_USER`, a constant: a ``k``
        read off the data would make the mechanism depend on it).
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
        public_seed: int | None = None,
        engine: str = "auto",
        max_memory: int | str | None = None,
        jit_compile: JitCompile = "auto",
        augmult: int = 1,
        augmentation=None,
        ema: float | None = None,
        use_ema_weights: bool | None = None,
        bands: int = 1,
        unit: str = "example",
        examples_per_user: int | None = None,
        name: str | None = None,
    ):
        super().__init__(name=name or f"dp_{model.name}")
        reject_unscopable_name(model)
        reject_batch_mixing_layers(model)
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling={sampling!r} is not one of {SAMPLING_MODES}")
        if one_of_problem(engine, ENGINES):
            raise ValueError(f"engine={engine!r} {one_of_problem(engine, ENGINES)}")
        self.model = model
        check_decay(ema)
        if use_ema_weights is not None and ema is None:
            raise ValueError(f"use_ema_weights={use_ema_weights} has no effect without ema: pass ema=0.999 (weight "
                             "averaging) or leave use_ema_weights out")
        self._ema, self._use_ema_weights = ema, use_ema_weights is not False
        self.weight_average: WeightAverage | None = None  # built by compile when ema is set
        self._mechanism = DpSgdMechanism(noise_multiplier, sample_rate, clip_norm, dataset_size, delta, bands)
        if self._mechanism.bands > 1 and sampling != "poisson":
            raise ValueError(f"bands={bands} needs cyclic Poisson sampling, which sampling={sampling!r} is not: "
                             "use sampling='poisson' or bands=1")
        self.correlated_noise: CorrelatedNoise | None = None  # BandMF's noise state, built by compile
        self._sampling_layout = SamplingLayout(self._mechanism.bands)  # every step cyclic (plain: make_private's)
        self.unit = check_user_level(unit, examples_per_user, sampling, self._mechanism.bands)
        self._users = (UserUnits(DEFAULT_EXAMPLES_PER_USER if examples_per_user is None else examples_per_user)
                       if self.unit == "user" else None)
        self.physical_batch_size = physical_batch_size
        self.sampling = sampling
        self.engine_name = engine
        self.max_memory = memory_bytes(max_memory)
        self._jit_compile_setting = jit_compile
        public_seed = distribute.agree_on_seed(tf.distribute.get_strategy(),
                                               random_streams.public_seed_of(public_seed, seed), "public_seed")
        seed = distribute.agree_on_seed(tf.distribute.get_strategy(), seed)
        self.dp_step = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="dp_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self._noise_seed = tf.Variable(seed, dtype=tf.int64, trainable=False, name="noise_seed")
        self._public_seed = tf.Variable(public_seed, dtype=tf.int64, trainable=False, name="public_seed")
        # the examples (a digest, in order) cyclic sampling drew its groups for: fit_inputs.check_same_cyclic_examples
        self.cyclic_examples: str | None = None
        check_multiplicity(augmult)
        self._views = (AugmentationMultiplicity(augmult, augmentation, self._public_seed)
                       if augmult > 1 or augmentation is not None else None)
        self.ledger = (
            PrivacyLedger(self._mechanism.delta, accountant=accountant, target_epsilon=target_epsilon,
                          sampling=sampling, unit=self.unit)
            if self._mechanism.delta is not None else None
        )
        adapted = adapted_state_caveat(model)
        if adapted is not None and self.ledger is not None:
            self.ledger.record_caveat(adapted)
        self._trainable_set: TrainableSet | None = None
        self._masked_optimizer: MaskedOptimizer | None = None
        self._release: Release | None = None  # None: DP-SGD's gradient release
        self._gradient_filter: GradientFilter = KEEP_ALL
        self.privacy_callback: PrivacyCallback | None = None
        self._engine = None
        self._per_example_loss = None
        self._loss_tracker = tf.keras.metrics.Mean(name="loss")
        self._non_finite = NonFiniteExamples()  # sampled examples dropped as non-finite, per epoch
        self._model_probed = False
        self.private_run = None  # set by sparta_tf.make_private
        self.canaries = None  # a white-box audit's gradient canaries (attach_canaries)

    # ------------------------------------------------------------------ model

    def attach_canaries(self, canaries) -> None:
        """Makes every DP gradient step of ``fit`` run with a white-box audit's gradient canaries
        (:class:`~sparta_tf.audit.gradient_canaries.GradientCanaries`): they join the sampler as extra
        participants (examples, or users with ``unit="user"``), the clipped sum before the noise, and are
        observed after it."""
        if self.sampling != "poisson":
            raise ValueError("white-box canaries join Poisson sampling: audit a run with sampling='poisson'")
        self.canaries = canaries
        self._engine = None

    def attach_run(self, run) -> None:
        """Makes ``fit`` run ``run``'s method and plan (:class:`sparta_tf.private_training.PrivateRun`)."""
        self.private_run = run

    @property
    def mechanism(self) -> DpSgdMechanism:
        """What every DP step of this model is (``sigma``, ``q``, ``C``, ``n``, ``delta``): the one object
        the step, the sampler, the selection scorer and the ledger's charge read."""
        return self._mechanism

    @property
    def sampling_layout(self) -> SamplingLayout:
        """How each global DP step samples, read by the sampler and the ledger's charge
        (:mod:`sparta_tf.privacy.layout`): with bands, every step cyclic unless a planned run
        (:func:`sparta_tf.make_private`) names the steps of its phases that release no gradient."""
        return self._sampling_layout

    def set_sampling_layout(self, layout: SamplingLayout) -> None:
        """Sets the layout of the following ``fit`` (its bands must be the mechanism's)."""
        if layout.bands != self._mechanism.bands:
            raise ValueError(f"a sampling layout with bands={layout.bands} for a mechanism with "
                             f"bands={self._mechanism.bands}; build it from the run's plan")
        if layout != self._sampling_layout:
            self._sampling_layout = layout
            self._retrace()  # the correlated noise reads the layout's plain steps when the step is traced

    @property
    def releases_gradient(self) -> bool:
        """Whether the following DP steps release the noisy gradient (DP-SGD's release, with the run's
        correlated noise when it has bands, or a release that adds that noise, e.g. one wrapping DP-SGD's)
        rather than another statistic (a selection epoch's scores)."""
        noise = self.correlated_noise
        return (self._release is None or isinstance(self._release, GradientRelease)
                or (noise is not None and getattr(self._release, "noise", None) is noise))

    def bind_dataset_size(self, n: int) -> None:
        """Fixes ``n`` (from the arrays ``fit`` got) when it was not given; ValueError when it differs."""
        self._mechanism = self._mechanism.with_dataset_size(n)

    noise_multiplier = property(lambda self: self._mechanism.noise_multiplier, doc="``sigma`` of :attr:`mechanism`.")
    sample_rate = property(lambda self: self._mechanism.sample_rate, doc="``q`` of :attr:`mechanism`.")
    clip_norm = property(lambda self: self._mechanism.clip_norm, doc="``C`` of :attr:`mechanism`.")
    dataset_size = property(lambda self: self._mechanism.dataset_size,
                            doc="``n`` of :attr:`mechanism` (None until a ``fit`` with arrays, when not given).")

    plan = property(lambda self: None if self.private_run is None else self.private_run.plan,
                    doc="The run's :class:`~sparta_tf.privacy.plan.PrivacyPlan` (from ``make_private``), else None.")
    method = property(lambda self: None if self.private_run is None else self.private_run.method,
                      doc="The :class:`~sparta_tf.methods.Method` ``fit`` runs (from ``make_private``), else None.")

    @property
    def views(self) -> AugmentationMultiplicity | None:
        """The step's augmentation multiplicity (None: each example as is)."""
        return self._views

    @property
    def users(self) -> UserUnits | None:
        """The step's user units (``unit="user"``), else None."""
        return self._users

    @property
    def rows_per_unit(self) -> int:
        """The rows the engine treats as one unit: ``K`` views, times ``k`` with user units."""
        return self.augmult * (1 if self._users is None else self._users.examples_per_user)

    @property
    def augmult(self) -> int:
        """``K``, the augmented views per example (1 without augmentation multiplicity)."""
        return 1 if self._views is None else self._views.views

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    @property
    def seed(self) -> int:
        """The run seed of every secret random stream (:mod:`sparta_tf.random_streams`). Secret: whoever
        knows it can recompute the noise and the batches; store it only with private checkpoints. It is
        a variable of :meth:`checkpoint_state`, so a restored model samples (and, with ``bands > 1``,
        keeps each example's cyclic group) as the run it continues, not only draws its noise."""
        return int(self._noise_seed.numpy())

    @property
    def public_seed(self) -> int:
        """The seed of the public streams (:mod:`sparta_tf.random_streams`: random masks and pre-pruning,
        gradient dropping, augmentation), whose draws a release may show. The run seed when one was
        given; otherwise drawn independently of it, so a release tells nothing about :attr:`seed`. A
        variable of :meth:`checkpoint_state`."""
        return int(self._public_seed.numpy())

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
                if self.correlated_noise is not None:
                    self.correlated_noise.build(trainable_set)
        self._retrace()

    def begin_scoring(self, scorer) -> None:
        """From the next step on, steps release mask scores to ``scorer`` instead of updating weights
        (``set_release(ScoreRelease(scorer, ...))``). A scorer that is not private (``score="oracle"``:
        unclipped, noiseless) marks the ledger."""
        if not scorer.private and self.ledger is not None:
            self.ledger.record_nonprivate(f"selection scores {scorer.score!r}: unclipped, noiseless gradients")
        self.set_release(ScoreRelease(scorer, self._noise_seed))

    def end_scoring(self) -> None:
        """Back to DP-SGD updates of the trainable set."""
        self.set_release(None)

    def _retrace(self) -> None:
        """Drops the traced step; rebuilds it at once inside a running ``fit``."""
        keras_trainer.retrace(self)

    @property
    def metrics(self):
        """The mean per-example loss over real examples, the compiled metrics, the examples dropped."""
        return [self._loss_tracker] + keras_trainer.compiled_metrics(self) + [self._non_finite]

    def _update_metrics(self, y, predictions, losses, weights):
        self._loss_tracker.update_state(losses, sample_weight=weights)
        keras_trainer.update_compiled_metrics(self, y, predictions, weights)

    def test_step(self, data):
        x, y, weights = distribute.at_least_one_row(*tf.keras.utils.unpack_x_y_sample_weight(data))
        predictions = self(x, training=False)
        self._update_metrics(y, predictions, self._per_example_loss(y, predictions), weights)
        logs = {k: v for k, v in keras_trainer.metrics_result(self).items() if k != NON_FINITE}  # DP steps' only
        return distribute.reducible_logs(logs, self.distribute_strategy)

    def predict_step(self, data):
        """``self(x)``; a replica's empty share of a batch runs as one zero row, dropped from the output
        (:func:`~sparta_tf.distribute.inputs_with_one_row`)."""
        x, _, _ = tf.keras.utils.unpack_x_y_sample_weight(data)
        padded, rows = distribute.inputs_with_one_row(x)
        return tf.nest.map_structure(lambda output: output[:rows], self(padded, training=False))

    @property
    def noise_drawn_by_xla(self) -> bool:
        """Whether the DP step (and so its noise draw) is compiled with XLA: XLA draws other Gaussians
        than TensorFlow's kernels for the same key, so a resumed run must draw as the killed one did."""
        return resolve_jit_compile(self._jit_compile_setting)

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
        weighted = fit_inputs.all_weighted(metrics, kwargs.pop("weighted_metrics", None))
        training_logs.check_metric_names(weighted, getattr(self.model, "output_names", None))
        super().compile(
            optimizer=optimizer, loss=loss, weighted_metrics=weighted,
            jit_compile=resolve_jit_compile(self._jit_compile_setting), **kwargs,
        )
        self._masked_optimizer = MaskedOptimizer(self.optimizer)
        with self.distribute_strategy.scope():
            self._masked_optimizer.build(self.trainable_set)
            if self._mechanism.bands > 1:
                self.correlated_noise = CorrelatedNoise(self._mechanism, self._noise_seed,
                                                        self._masked_optimizer.workload_momentum,
                                                        layout=lambda: self.sampling_layout)
                self.correlated_noise.build(self.trainable_set)
            if self._ema is not None:
                self.weight_average = WeightAverage(self._ema, self.model.trainable_variables)

    # ------------------------------------------------------------- train step

    def set_release(self, release: Release | None) -> None:
        """What the following steps release (:mod:`sparta_tf.dp_step.release`): e.g. a
        :class:`~sparta_tf.dp_step.ScoreRelease` during a selection epoch; None: the noisy
        gradient to the optimizer (DP-SGD), from :attr:`mechanism`."""
        self._release = release
        self._engine = None
        self._retrace()

    def set_gradient_filter(self, gradient_filter: GradientFilter | None) -> None:
        """The coordinates ``I_s`` each DP-SGD step trains within the trainable set
        (:mod:`sparta_tf.dp_step.keep`), e.g. DP-SSGD's gradient dropping; None: all of them."""
        self._gradient_filter = KEEP_ALL if gradient_filter is None else gradient_filter
        self._engine = None
        self._retrace()

    @property
    def gradient_filter(self) -> GradientFilter:
        return self._gradient_filter

    def engine_cost_table(self) -> list:
        """Per selected variable, how the book-keeping engine computes its per-example norms
        (``NormMethod``: method and the cost model's numbers) in the last traced step; empty
        before the first step or with a materialising engine."""
        return self._engine.cost_table() if isinstance(self._engine, BookkeepingEngine) else []

    def engine_memory_plan(self):
        """How the book-keeping engine's last traced step kept its output gradients
        (:class:`~sparta_tf.per_example.memory_budget.MemoryPlan`: one or two passes, the budget, what
        one pass would keep and what the step keeps, in bytes); None before a step was traced or with
        a materialising engine."""
        return self._engine.memory_plan() if isinstance(self._engine, BookkeepingEngine) else None

    def _make_engine(self):
        """The per-example engine of the current release and filter (:func:`~sparta_tf.per_example.make_engine`)."""
        release = self._release or self._gradient_release()
        materialise = release.needs_per_example_gradients() or self._gradient_filter.needs_per_example_gradients
        reserved = 0 if self.correlated_noise is None else self.correlated_noise.memory_bytes
        return make_engine(self.model, release.selections(self.trainable_set), self.engine_name,
                           materialise=materialise, views=self.rows_per_unit,
                           max_memory=step_budget(self.max_memory, reserved))

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras 3 builds the model from ``fit``'s first batch averaged over the replicas, which fails
        across several workers: :func:`fit_inputs.symbolic_build_batch`. (Keras 2 never calls this.)"""
        iterator, data_batch = fit_inputs.symbolic_build_batch(self, iterator, data_batch)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def make_train_function(self, force: bool = False):
        """Keras' ``make_train_function``, with the step's engine built first (eagerly, not while tracing)."""
        if self._engine is None or force:
            self._engine = self._make_engine()
        return super().make_train_function(force=force)

    def _gradient_release(self) -> GradientRelease:
        """DP-SGD's release of :attr:`mechanism` (``sigma, C, q, n``) to the optimizer."""
        return GradientRelease.of_mechanism(self._mechanism, self._noise_seed, self._masked_optimizer,
                                            self.weight_average, self.correlated_noise, self.canaries)

    def step_parts(self) -> StepParts:
        """The parts a step traced now runs with (:mod:`sparta_tf.dp_step`); configuration only."""
        release = self._release or self._gradient_release()
        return StepParts(
            engine=self._engine if self._engine is not None else self._make_engine(),
            gradient_filter=self._gradient_filter if release.uses_gradient_filter else KEEP_ALL,
            micro_batches=MicroBatches.per_replica(
                self.physical_batch_size, 1 if self._users is None else self._users.examples_per_user),
            release=release,
            trainable_set=self.trainable_set,
            views=self._views,
            users=self._users,
        )

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
        self.step_parts().run(x, y, weights, self._per_example_loss, self.dp_step, self._update_metrics,
                              self._non_finite.update_state)
        self.dp_step.assign_add(1)
        return distribute.reducible_logs(self.get_metrics_result(), self.distribute_strategy)

    # -------------------------------------------------------------------- fit

    def train_on_batch(self, *args, **kwargs):
        """Keras' ``train_on_batch``: one DP step on the batch given. The batch is not a Poisson sample and
        the step is outside ``fit``'s ledger and checks, so the run is marked not private (with a warning);
        use it to test a model, train with ``fit``."""
        fit_inputs.mark_batch_outside_fit(self)
        return super().train_on_batch(*args, **kwargs)

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
        users=None,
        **kwargs,
    ):
        """``keras.Model.fit`` with DP input and privacy bookkeeping.

        Arrays ``x, y`` are fed as Poisson samples (or shuffled batches when
        ``sampling="shuffle"``) with ``round(1/q)`` steps per epoch; a
        ``tf.data.Dataset`` is used as given (it must come from
        :class:`sparta_tf.privacy.PoissonSampler` for the accounting to hold).
        When the model has a ledger, ``epsilon`` is logged every epoch.

        ``users``: with ``unit="user"``, each example's user id (ints or strings, one per example of
        the arrays ``x``); the batches are then Poisson samples of users (:attr:`users`).

        ``epochs``: default 1, or for a model from :func:`sparta_tf.make_private` the planned
        epochs, whose ``fit`` also runs the method's phases (and with ``run_dir`` resumes a killed run;
        see :mod:`sparta_tf.private_training`).
        """
        callbacks = list(callbacks or [])
        users_callbacks = list(callbacks)
        first = fit_inputs.first_element(x)
        keys = fit_inputs.log_keys(self, x, kwargs.get("validation_data"), callbacks)
        fit_inputs.check_fit_call(self, first, kwargs, callbacks, users, steps_per_epoch, keys)  # before any charge
        fit_inputs.check_same_examples_on_workers(self, x, y, users)
        if self.private_run is not None:
            epochs, initial_epoch, callbacks = self.private_run.before_fit(
                self, x, y, epochs, initial_epoch, callbacks, users)
        elif epochs is None:
            epochs = 1
        x, y, steps_per_epoch = fit_inputs.prepare(self, x, y, steps_per_epoch, first, users)
        if isinstance(x, tf.data.Dataset):
            kwargs.setdefault("shuffle", False)  # the batches are the sampler's (Keras 3 warns on shuffle=True)
        self.privacy_callback = charging.model_callback(self, callbacks, steps_per_epoch, on_budget_exhausted)
        if self.weight_average is not None:
            callbacks.append(AveragedWeights(self.weight_average, self._use_ema_weights))
        if self._sampling_layout.plain:
            callbacks.append(PlainStepsGuard(self))
        callbacks = fit_inputs.fit_callbacks(self.privacy_callback, callbacks, verbose, self._non_finite,
                                             "users" if self.unit == "user" else "examples")
        watched = (training_logs.watched_callbacks(users_callbacks, keys, training_logs.private_read_marker(self.ledger))
                   if self.ledger is not None else contextlib.nullcontext())
        try:
            with watched:
                return super().fit(
                    x, y, epochs=epochs, verbose=verbose, callbacks=callbacks,
                    steps_per_epoch=steps_per_epoch, initial_epoch=initial_epoch, **kwargs,
                )
        finally:  # a fit stopped by an exception (Ctrl-C, a callback) skips on_train_end: charge what ran
            if self.privacy_callback is not None:
                self.privacy_callback.flush()
