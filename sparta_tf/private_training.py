"""``make_private``: one call from a Keras model to a DP model whose ``fit`` runs a whole method.

::

    dp = sparta_tf.make_private(model, method="sparta", target_epsilon=4.0, delta=1e-5,
                                epochs=15, batch_size=64, dataset_size=len(x), warmup_epochs=3)
    dp.compile(optimizer, loss=..., metrics=["accuracy"])
    dp.fit(x, y, validation_data=(x_test, y_test))        # every phase of the method, epochs from the plan

What it computes once, before any data is touched, is the run's
:class:`~sparta_tf.privacy.plan.PrivacyPlan` (the object ``sparta-train``
prints in its dry run): ``q = min(1, batch_size / n)``, ``round(1/q)`` steps
per epoch, the method's phases, and one noise multiplier ``sigma`` for every
step of every phase, calibrated so that the composition of all of them (and
of the mechanisms the method runs before training) stays within
``(target_epsilon, delta)``. The DP model is built from exactly the plan's
``sigma``, ``q``, ``n`` and ``delta`` (its one
:class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`, ``dp.mechanism``), its
ledger starts with the plan's reasons a run is not private, and every step,
resumed ones included, is charged as that mechanism
(:mod:`sparta_tf.privacy.charging`; :class:`PrivateRun` holds no second copy).

``fit`` of the returned model (:meth:`PrivateRun.before_fit`):

1. runs the method's preparation (DP-FROST's partition selection, DP-SSGD's
   pre-pruning) on the training arrays, charging its mechanisms;
2. drives the method's phases with a :class:`~sparta_tf.callbacks.MethodCallback`
   (warm-up, selection, sparse for SPARTA);
3. with ``run_dir``: journals every step before it runs and checkpoints after
   every epoch (:mod:`sparta_tf.checkpointing`). A process killed mid-``fit``
   is resumed by running the same script again: the next ``fit`` restores the
   last checkpoint and charges every step the killed process started after it,
   so epsilon never under-counts (the budget then stops training early rather
   than overspend).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import tensorflow as tf

from sparta_tf import checkpointing, distribute, masks, resume_inputs, run_checks
from sparta_tf.methods import Method, make_method
from sparta_tf.privacy import charging
from sparta_tf.privacy.ledger import PrivacyLedger, check_unit
from sparta_tf.privacy.plan import PrivacyPlan, make_privacy_plan, sample_rate
from sparta_tf.privacy.tuning import Repetition

MASK_DIR = "mask"


def plan_method(
    method: Method,
    *,
    dataset_size: int,
    batch_size: float,
    epochs: int,
    delta: float,
    target_epsilon: float | None,
    noise_multiplier: float | None = None,
    accountant: str = "pld",
    nonprivate_reasons: tuple[str, ...] | list[str] = (),
    tuning: Repetition | None = None,
    bands: int = 1,
    unit: str = "example",
) -> PrivacyPlan:
    """The :class:`PrivacyPlan` of ``epochs`` epochs of ``method`` on ``dataset_size`` examples with
    expected batch ``batch_size``. A given ``noise_multiplier`` that would spend more than
    ``target_epsilon`` is refused (:class:`~sparta_tf.privacy.plan.FixedNoiseOverBudgetError`, one line).
    ``tuning``: the plan of one candidate of a private tuning whose whole procedure meets the target
    (:func:`~sparta_tf.privacy.plan.make_privacy_plan`). ``unit="user"``: ``dataset_size`` and
    ``batch_size`` count users, as do the method's mechanisms before training (a method whose mechanisms
    before training do not count users is refused)."""
    n = int(dataset_size)
    if n < 1:
        raise ValueError(f"dataset_size={dataset_size!r}: need at least 1 private training example")
    check_unit_of_method(method, unit, n, batch_size)
    return make_privacy_plan(
        n=n, expected_batch_size=batch_size, phases=method.phases(epochs), delta=delta,
        target_epsilon=target_epsilon, accountant=accountant, noise_multiplier=noise_multiplier,
        before_training=method.mechanisms_before_training(n, sample_rate(n, batch_size)),
        training_share=method.training_share,
        nonprivate_reasons=list(method.nonprivate_reasons()) + list(nonprivate_reasons), tuning=tuning,
        bands=bands, unit=unit,
    )


def make_private(
    model: tf.keras.Model,
    *,
    method: str | Method = "sparta",
    target_epsilon: float,
    delta: float,
    epochs: int,
    batch_size: float,
    dataset_size: int,
    clip_norm: float = 1.0,
    noise_multiplier: float | None = None,
    accountant: str = "pld",
    physical_batch_size: int | None = None,
    sampling: str = "poisson",
    seed: int | None = None,
    public_seed: int | None = None,
    engine: str = "auto",
    max_memory: int | str | None = None,
    jit_compile: Any = "auto",
    augmult: int = 1,
    augmentation: Any = None,
    run_dir: str | None = None,
    ema: float | None = None,
    use_ema_weights: bool | None = None,
    bands: int = 1,
    unit: str = "example",
    examples_per_user: int | None = None,
    data: Any = None,
    **method_options: Any,
):
    """A DP model for ``model`` whose ``fit`` runs ``method`` within ``(target_epsilon, delta)``.

    Args:
      model: the Keras model to fine-tune (its weights are trained in place).
      method: a name from :data:`sparta_tf.methods.METHODS` or a :class:`~sparta_tf.methods.Method`.
      target_epsilon: the privacy budget's epsilon for the whole run (every phase, and what the
        method runs before training).
      delta: the budget's delta.
      epochs: epochs of the whole run (SPARTA: warm-up + selection + sparse).
      batch_size: expected Poisson batch size ``q n``.
      dataset_size: ``n``, the number of private training examples ``fit`` will get.
      clip_norm: per-example L2 bound ``C``.
      noise_multiplier: ``sigma``; None calibrates it from the target (a given one must fit it).
      accountant: ``"pld"`` or ``"rdp"`` (dp-accounting).
      physical_batch_size: examples per micro-batch, as for :class:`~sparta_tf.DPModel`.
      sampling: ``"poisson"`` (what the accountant assumes) or ``"shuffle"``.
      seed: the run seed every secret random stream derives from (None: a secret one from the OS).
      public_seed: the seed of the public streams, whose draws a release may show (a random mask):
        None is ``seed`` when given, else one drawn independently of the secret seed.
      engine: the per-example engine (``"auto"``: book-keeping where it applies).
      max_memory: the bytes of layer output gradients a book-keeping step may keep (an int or
        ``"2GiB"``); above it the step runs in two backward passes and keeps none. None: a quarter of
        the GPU's, else the host's available memory (as for :class:`~sparta_tf.DPModel`).
      jit_compile: ``"auto"`` (XLA on GPU/TPU, off on CPU), True or False.
      augmult: ``K`` augmented views per example, their gradients averaged before clipping
        (augmentation multiplicity; 1: none). The privacy analysis does not depend on ``K``.
      augmentation: how a view is drawn (None: random flip + pad-and-crop of images), as for
        :class:`~sparta_tf.DPModel`.
      run_dir: a directory for the step journal, a checkpoint per epoch and the ledger; running
        the same script again resumes a killed ``fit`` there. None: nothing written (except masks
        when ``mask_dir`` is given).
      ema: a decay in (0, 1) (e.g. 0.999) to keep an exponential moving average of the weights
        (:mod:`sparta_tf.optim.weight_average`; post-processing, no privacy cost); None (default): none.
      use_ema_weights: with ``ema``, validation and the model after ``fit`` (evaluate, save, export) use
        the averaged weights (None, the default: True with ``ema``); False: the raw weights; refused without ``ema``.
      bands: ``b``, BandMF's correlated noise in every DP step of the run (as for :class:`~sparta_tf.DPModel`):
        cyclic Poisson sampling at ``b q`` and ``ceil(T_p / b)`` charged steps per phase, with the noise
        multiplier calibrated for that; 1 (the default): independent noise (DP-SGD). Needs ``b q <= 1``
        and at least ``b`` steps in every phase.
      unit: ``"example"`` (the default) or ``"user"``: user-level DP, as for :class:`~sparta_tf.DPModel`;
        ``fit(x, y, users=ids)`` then samples users, and ``dataset_size`` and ``batch_size`` count users.
      examples_per_user: ``k``, the most examples of one user in a step (``unit="user"``; None: the
        constant 8, not read off the data).
      data: the :class:`sparta_tf.data.Dataset` that ``fit`` trains on, when :func:`sparta_tf.data.load_dataset`
        loaded it: what it computed from the private data without noise (``normalize: standard`` without
        ``mean``/``std``) marks the plan and the ledger not private, and what it assumes (a known split key,
        class names read off the labels, ...) becomes ledger caveats, as ``sparta-train`` records them.
      **method_options: the method's options (``warmup_epochs``, ``density``, ... for sparta), as
        :func:`sparta_tf.methods.make_method` takes them.

    Returns the DP model (a :class:`~sparta_tf.DPModel`, or DP-SSGD's subclass) with ``.plan`` and
    ``.method``. Raises ValueError (one line) for an option, budget or size that cannot work.
    """
    if run_dir is not None:
        method_options.setdefault("mask_dir", os.path.join(run_dir, MASK_DIR))
    if isinstance(method, Method):
        if method_options:
            raise ValueError("pass options to the Method itself, or pass the method by name with its options")
    else:
        method = make_method(method, **method_options)
    run_checks.check_run(run_checks.LIBRARY, epochs=epochs, batch_size=batch_size, noise_multiplier=noise_multiplier,
                         engine=engine, physical_batch_size=physical_batch_size, jit_compile=jit_compile,
                         private=method.private)
    run_checks.check_against_data(run_checks.LIBRARY, dataset_size=dataset_size, batch_size=batch_size, delta=delta)
    run_checks.check_method_run(run_checks.LIBRARY, method.name, method.option_values, epochs)
    method.check(model)
    plan = plan_method(method, dataset_size=dataset_size, batch_size=batch_size, epochs=epochs, delta=delta,
                       target_epsilon=target_epsilon, noise_multiplier=noise_multiplier, accountant=accountant,
                       bands=bands, unit=unit, nonprivate_reasons=() if data is None else data.nonprivate_reasons())
    dp = private_model(model, method, plan, run_dir=run_dir, clip_norm=clip_norm,
                       physical_batch_size=physical_batch_size, sampling=sampling, seed=seed,
                       public_seed=public_seed, engine=engine, max_memory=max_memory, jit_compile=jit_compile,
                       augmult=augmult, augmentation=augmentation, ema=ema, use_ema_weights=use_ema_weights,
                       examples_per_user=examples_per_user)
    for caveat in () if data is None else data.privacy_caveats():
        dp.ledger.record_caveat(caveat)
    return dp


def check_unit_of_method(method: Method, unit: str, dataset_size: int, batch_size: float) -> None:
    """One line, before anything is charged, for ``unit="user"`` with a method whose mechanisms before
    training run over examples (:attr:`~sparta_tf.methods.base.Method.users_before_training` False): their
    analysis would be per example; and for mechanisms another run ran at another unit (a loaded mask's,
    :meth:`~sparta_tf.methods.base.Method.unit_of_recorded_mechanisms`)."""
    recorded = method.unit_of_recorded_mechanisms()
    if recorded is not None and recorded != check_unit(unit):
        raise ValueError(f"method {method.name!r} loads a mask chosen by a run that protected one {recorded}, but "
                         f"this run protects one {unit}; its charge holds only at the unit it was made for: choose "
                         f"the mask again with unit={unit!r}, or train with unit={recorded!r}")
    if check_unit(unit) != "user" or method.users_before_training or recorded == "user":
        return
    n = int(dataset_size)
    if method.mechanisms_before_training(n, sample_rate(n, batch_size)):
        raise ValueError(f"method {method.name!r} runs a mechanism over examples before training, which "
                         "unit='user' does not cover; give the method users_before_training (its prepare counting "
                         "users), use a method without one, or unit='example'")


def private_model(model: tf.keras.Model, method: Method, plan: PrivacyPlan, *, run_dir: str | None = None,
                  seed: int | None = None, **dp_options: Any):
    """The DP model of ``method`` built with ``plan``'s ``sigma``, ``q``, ``n``, ``delta`` and budget (its
    ledger starting with the plan's reasons the run is not private), its ``fit`` running the plan
    (:class:`PrivateRun`); ``dp_options``: the other :class:`~sparta_tf.DPModel` arguments
    (``clip_norm``, ...). A ``run_dir`` holding a checkpoint continues that run's seed (the checkpoint
    also restores the noise seed and the ledger)."""
    previous = checkpointing.latest(run_dir) if run_dir is not None else None
    if previous is not None:
        seed = previous[1]["seed"]
        dp_options["public_seed"] = previous[1].get("public_seed", seed)
    dp = method.make_dp_model(
        model, noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate, dataset_size=plan.n,
        delta=plan.delta, target_epsilon=plan.run_budget, accountant=plan.accountant, seed=seed, bands=plan.bands,
        unit=plan.unit, **dp_options,
    )
    for reason in plan.nonprivate_reasons:
        dp.ledger.record_nonprivate(reason)
    dp.set_sampling_layout(plan.sampling_layout())  # anchored at the first step by fit (PrivateRun.before_fit)
    dp.attach_run(PrivateRun(plan, method, run_dir, previous, seed_given=seed is not None))
    return dp


@dataclasses.dataclass
class PrivateRun:
    """What ``make_private`` attaches to a DP model: the plan, the method, and (optionally) the run
    directory whose journal and checkpoints make a killed ``fit`` resumable."""

    plan: PrivacyPlan
    method: Method
    run_dir: str | None = None
    previous: tuple[str, dict] | None = None
    """``(checkpoint dir, state)``: the newest readable checkpoint in ``run_dir`` when the run was built
    (the run resumes from it), or None for a fresh run."""
    seed_given: bool = False
    """Whether the caller fixed the run seed: a run restarted before its first checkpoint then runs the
    mechanisms before training again under the same noise (else under a new secret seed)."""
    prepare_info: dict = dataclasses.field(default_factory=dict)
    checkpoint: "EpochCheckpoint | None" = None
    _started: bool = False
    _fit_called: bool = False

    @property
    def budget_mode(self) -> str:
        """A resumed run has charged the steps its killed process ran, so the whole plan may no longer
        fit: it trains while the budget lasts and stops early instead of refusing to start."""
        return "until_exhausted" if self.run_dir is not None else "strict"

    def before_fit(self, dp, x, y, epochs: int | None, initial_epoch: int, callbacks: list,
                   users=None) -> tuple[int, int, list]:
        """The ``(epochs, initial_epoch, callbacks)`` of the method's ``fit`` on ``dp`` (module doc); ``users``:
        ``fit``'s, for the method's mechanisms before training."""
        from sparta_tf.callbacks import MethodCallback  # late: callbacks imports the DP model

        if self._fit_called:
            again = ("run the script again to resume from run_dir" if self.run_dir is not None
                     else "call make_private again for another run (the ledger keeps what ran)")
            raise ValueError(f"this run's fit was called already (one fit runs all {self.plan.epochs} planned "
                             f"epochs; epsilon so far {dp.ledger.epsilon():.4g}); {again}")
        if epochs is not None and epochs != self.plan.epochs:
            raise ValueError(f"fit(epochs={epochs}) but the plan is for {self.plan.epochs} epochs; leave epochs "
                             "out, or make_private(..., epochs=...) to plan another length")
        if initial_epoch:
            raise ValueError("fit(initial_epoch=...) is chosen by the run itself (from run_dir's checkpoint); "
                             "leave it out")
        if any(isinstance(c, MethodCallback) for c in callbacks):
            raise ValueError("make_private's model runs its method itself; remove the MethodCallback")
        previous = self.previous
        first_epoch = previous[1]["epoch"] if previous else 0
        distribute.check_same_checkpoint(dp.distribute_strategy, first_epoch if previous else None)
        inputs = (None if self.run_dir is None
                  else resume_inputs.resume_inputs(dp, self.plan, x, y, users, method=self.method))
        if not self._started:
            self._start(dp, x, y, first_epoch, fresh=previous is None, users=users, inputs=inputs)
        method_callback = MethodCallback(self.method)
        method_callback.begin(dp, self.plan.epochs, first_epoch)
        if previous is not None:
            restore_run(previous, dp, method_callback, self.plan, self.run_dir, inputs)
        distribute.check_same_step(dp.distribute_strategy, int(dp.dp_step.numpy()))
        # the run's first step: dp_step less the finished epochs (a run restarted before its first checkpoint
        # starts at the steps the killed one ran, for fresh keys)
        first_step = int(dp.dp_step.numpy()) - first_epoch * self.plan.steps_per_epoch
        dp.set_sampling_layout(self.plan.sampling_layout(first_step))
        self._fit_called = True  # a fit that raised is resumed through run_dir by a new process
        if self.run_dir is None:
            return self.plan.epochs, first_epoch, [method_callback] + list(callbacks)
        # The checkpoint last: a callback that stops the epoch (a non-finite guard) runs before it is saved.
        self.checkpoint = EpochCheckpoint(self.run_dir, dp, lambda: trained_mask(self.method), inputs)
        journal = charging.StepJournal(self.run_dir)
        return self.plan.epochs, first_epoch, [method_callback, journal] + list(callbacks) + [self.checkpoint]

    def _start(self, dp, x, y, first_epoch: int, fresh: bool, users=None, inputs: dict | None = None) -> None:
        """Once per process: charge what a killed run left in the journal, then the method's preparation;
        with a fixed seed, ``inputs`` (:func:`~sparta_tf.resume_inputs.resume_inputs`) must be those of the
        mechanisms a killed run ran before training, which this one runs again under the same noise."""
        if self.run_dir is not None and fresh and self.seed_given:  # a secret seed draws them anew
            path, recorded = charging.inputs_before_training(self.run_dir)
            resume_inputs.check_same_inputs(path, recorded, inputs)
        self._started = True
        if self.run_dir is not None and fresh:
            releases = self.plan.before_training_entries(releases_only=True)
            charging.charge_steps_before_first_checkpoint(dp, releases, self.run_dir)
            charging.journal_before_training(self.run_dir, dp.ledger, releases, inputs)
        by_user = {} if users is None else {"users": users}  # a method of its own may not take users
        self.prepare_info = self.method.prepare(dp, x, y, tf.keras.losses.get(dp.loss), self.plan, first_epoch,
                                                **by_user)


def restore_run(previous: tuple[str, dict], dp, method_callback, plan: PrivacyPlan, run_dir: str,
                inputs: dict | None = None) -> None:
    """Restores the last checkpoint into ``dp`` and charges the steps the killed run started after it
    (as ``dp.mechanism``, what they ran); ``inputs``: this run's :func:`~sparta_tf.resume_inputs.resume_inputs`,
    which must be the checkpoint's."""
    path, state = previous
    if inputs is not None:
        resume_inputs.check_same_inputs(f"checkpoint {path}", state.get(resume_inputs.STATE_KEY), inputs)
    check_same_noise_draws(path, state, dp)
    check_same_mask(path, state, trained_mask(method_callback.method))
    dp.cyclic_examples = state.get("cyclic_examples")  # the resumed fit must sample the same examples' groups
    epoch = state["epoch"]
    restored = PrivacyLedger.from_json(state["ledger"])
    if restored.unit != plan.unit:
        raise checkpointing.CheckpointError(
            f"checkpoint {path} was written by a run that protected one {restored.unit}, but this run protects one "
            f"{plan.unit}; resume with unit={restored.unit!r}, or start a new output_dir")
    restored.absorb(dp.ledger)  # what this process charged or marked already (a fit's non-private callback)
    dp.ledger = restored
    dp.ledger.target_epsilon = plan.run_budget if dp.ledger.is_private else None
    # Recreates the trainable set (and optimizer slots) of that epoch's phase; a run killed after its last
    # epoch restores into the last phase and trains no more.
    method_callback.on_epoch_begin(min(epoch, plan.epochs - 1))
    checkpointing.restore(path, dp)
    lost = charging.charge_interrupted_steps(run_dir, int(dp.dp_step.numpy()), dp.ledger, dp.mechanism,
                                             dp.distribute_strategy, dp.sampling_layout)
    charging.update_checkpoint_ledger(path, dp.ledger)  # a second kill cannot lose the charge
    print(f"== resuming after epoch {epoch} from {path}; {lost} step(s) of the interrupted epoch charged "
          f"to the ledger (epsilon so far {dp.ledger.epsilon():.4g})")


def check_same_noise_draws(path: str, state: dict, dp) -> None:
    """CheckpointError unless ``dp`` draws its noise as the run that wrote checkpoint ``path`` did (XLA or
    TensorFlow's kernels: other Gaussians for the same key). The steps a killed run started after its
    checkpoint are charged as more participations of the same mechanism; re-run with other noise on the
    same batches, the two releases of a step together would be one Gaussian of a smaller noise multiplier.
    A checkpoint that does not record it (written before it was recorded) is not checked."""
    written = state.get("noise_drawn_by_xla")
    if written is not None and bool(written) != dp.noise_drawn_by_xla:
        raise checkpointing.CheckpointError(
            f"checkpoint {path} was written by a run whose DP step was compiled {'with' if written else 'without'} "
            f"XLA, which draws other noise than this run would; resume with jit_compile={bool(written)} on the "
            "same kind of device (jit_compile 'auto' is XLA on GPU/TPU only), or start a new output_dir")


def trained_mask(method) -> dict[str, str | None]:
    """The digests (:func:`~sparta_tf.masks.selections_digest`) a checkpoint records of what ``method``
    trains with now: ``trained``, of its :attr:`~sparta_tf.methods.base.Method.trained_selections`, and
    ``mask``, of its ``mask_selections`` alone (what checkpoints recorded before ``trained``, so that they
    resume). None: none chosen yet."""
    return {"trained": masks.selections_digest(getattr(method, "trained_selections", None)),
            "mask": masks.selections_digest(getattr(method, "mask_selections", None))}


def check_same_mask(path: str, state: dict, digests: dict[str, str | None]) -> None:
    """CheckpointError unless the resumed run trains with the coordinates (``digests``: :func:`trained_mask`)
    that the run which wrote checkpoint ``path`` had at that point: a mask loaded from another file, or a
    file replaced since, would train coordinates chosen by a mechanism its ledger (restored from the
    checkpoint) never charged. The checkpoint's ``trained`` digest is compared, or for a checkpoint written
    before it was recorded its ``mask`` digest; one that records neither is not checked."""
    key = "trained" if "trained" in state else "mask"
    if key in state and state[key] != digests[key]:
        raise checkpointing.CheckpointError(
            f"checkpoint {path} was written by a run that trained with {'no mask' if state[key] is None else 'another mask'} "
            f"at that point than this run {'loads' if digests[key] is not None else 'has'}; resume with the mask the "
            "run started with (method.mask / mask=, and its mask_dir unchanged), or start a new output_dir")


class EpochCheckpoint(tf.keras.callbacks.Callback):
    """After every epoch: a resumable checkpoint and ``ledger.json`` in ``run_dir``; times the phases.
    ``mask``: the digests of what the method trains with now (:func:`trained_mask`), kept in the checkpoint, as are
    ``inputs`` (:func:`~sparta_tf.resume_inputs.resume_inputs`), when given."""

    def __init__(self, run_dir: str, dp, mask=lambda: {}, inputs: dict | None = None):
        super().__init__()
        self.run_dir, self.dp, self.mask, self.inputs = run_dir, dp, mask, inputs
        self.phase_seconds: dict[str, float] = {}
        self._start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        privacy = self.dp.privacy_callback
        phase = (privacy.phase if privacy else None) or "train"
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.perf_counter() - self._start
        if privacy is not None:
            privacy.flush()
        state = {"seed": self.dp.seed, "public_seed": self.dp.public_seed, "ledger": self.dp.ledger.to_json(),
                 "noise_drawn_by_xla": self.dp.noise_drawn_by_xla, **self.mask()}
        if self.dp.cyclic_examples is not None:
            state["cyclic_examples"] = self.dp.cyclic_examples
        if self.inputs is not None:
            state[resume_inputs.STATE_KEY] = self.inputs
        checkpointing.save(self.run_dir, epoch + 1, self.dp, state)
        self.dp.ledger.save(os.path.join(self.run_dir, checkpointing.LEDGER))
