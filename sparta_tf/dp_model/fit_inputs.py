"""What ``DPModel.fit`` feeds the DP step, and the checks before its first step.

* arrays ``x, y`` of ``n`` examples become Poisson samples at rate ``q`` padded to a multiple of
  the physical batch size (:class:`~sparta_tf.privacy.sampling.PoissonSampler`, ``round(1/q)``
  steps per epoch, resumed at the model's ``dp_step``), or fixed-size shuffled batches of
  ``round(q n)`` (``sampling="shuffle"``, which the ledger says the accountant does not cover);
* a ``tf.data.Dataset`` is used as given, with its weights checked to be the 0/1 padding mask
  and a ledger caveat (and a :class:`NotPoissonSampledWarning` as ``fit`` starts) unless it is,
  unchanged, ``PoissonSampler(n, q).dataset``;
* before anything is charged, what ``fit`` cannot honour is refused in one line
  (:func:`check_fit_call`: no ``compile``, ``sample_weight``, ``class_weight``, ``batch_size``, a
  weighted dataset, a ``BackupAndRestore`` backup to restore);
* before the first step, on a few real examples: the model keeps examples apart in training mode
  and the engine's per-example rules see every trainable variable
  (:mod:`sparta_tf.model_checks`, :mod:`sparta_tf.per_example.coverage`).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import tensorflow as tf

from sparta_tf import distribute, keras_trainer
from sparta_tf.dp_model import training_logs
from sparta_tf.dp_step.usable_examples import DroppedExamplesReport
from sparta_tf.model_checks import first_examples, probe_batch_mixing, probe_loss_mixing
from sparta_tf.per_example import make_engine
from sparta_tf.per_example.coverage import check_coverage
from sparta_tf.privacy.array_inputs import examples_fingerprint
from sparta_tf.privacy.sampling import (
    PoissonSampler,
    default_physical_batch_size,
    poisson_provenance,
)
from sparta_tf.privacy.sampling import steps_per_epoch as planned_steps_per_epoch
from sparta_tf.privacy.user_sampling import (
    UserPoissonSampler,
    dense_user_ids,
)
from sparta_tf.privacy.shuffling import shuffled_dataset
from sparta_tf.trainable import TrainableSet


PADDING_MASK_ONLY = ("DP-SGD weighs every example the same (each clipped to C), so a weight would scale an "
                     "example's contribution past the clip bound; the only weights fit takes are the 0/1 padding "
                     "mask of PoissonSampler batches")


def first_element(x):
    """The first element of a ``tf.data.Dataset`` ``x`` (read once per ``fit``: the padding-mask check and
    the probe share it), else None."""
    return next(iter(x.take(1))) if isinstance(x, tf.data.Dataset) else None


def check_fit_call(dp, first, fit_kwargs: dict, callbacks: list, users=None,
                   steps_per_epoch: int | None = None, keys: training_logs.LogKeys = training_logs.LogKeys()) -> None:
    """Refuses, with one line and before anything is charged, what ``DPModel.fit`` cannot honour: a model
    not compiled, ``sample_weight`` / ``class_weight`` (:data:`PADDING_MASK_ONLY`), a ``batch_size``
    (the batches are Poisson samples of ``q n``), a dataset whose ``first`` element (:func:`first_element`)
    has weights other than 0 and 1, the Keras callbacks that would break the run
    (:func:`check_keras_callbacks`), and on Keras 3 a ``steps_per_execution`` that does not divide the
    epoch (``steps_per_epoch``, default ``round(1/q)``; :func:`~sparta_tf.keras_trainer.check_whole_calls`)."""
    if dp._per_example_loss is None:
        what = "the model returned by make_private" if dp.private_run is not None else "the DPModel"
        raise ValueError(f"compile {what} (optimizer and loss) before fit")
    for name in ("sample_weight", "class_weight"):
        if fit_kwargs.get(name) is not None:
            raise ValueError(f"fit({name}=...) is not supported: {PADDING_MASK_ONLY}; leave {name} out")
    if fit_kwargs.get("batch_size") is not None:
        expected = "q n" if dp.dataset_size is None else f"q n = {dp.sample_rate * dp.dataset_size:g}"
        raise ValueError(f"fit(batch_size={fit_kwargs['batch_size']!r}): the batches are Poisson samples of "
                         f"expected size {expected}, set by make_private(batch_size=...) or DPModel(sample_rate=...); "
                         "leave batch_size out (physical_batch_size= sets how many examples run at once)")
    if first is not None:
        check_first_padding_mask(first)
    check_users_argument(dp, first is not None, users)
    check_ledger_unit(dp)
    check_keras_callbacks(dp, callbacks, keys)
    keras_trainer.check_whole_calls(dp, steps_per_epoch or planned_steps_per_epoch(dp.sample_rate))


def check_same_examples_on_workers(dp, x, y, users=None) -> None:
    """On several workers, a :class:`~sparta_tf.distribute.ClusterError` (one line, before anything is
    charged) unless every worker's arrays hold the same examples in the same order
    (:func:`~sparta_tf.distribute.check_same_examples`); a dataset is each worker's own to build."""
    if x is None or isinstance(x, tf.data.Dataset) or not distribute.is_multi_worker(dp.distribute_strategy):
        return
    distribute.check_same_examples(dp.distribute_strategy, examples_fingerprint(x, (y, users)))


UNCHECKED_VALIDATION = ("validation_data is a tf.data.Dataset (or the training data is), so it was not checked for "
                        "training examples; what callbacks decide from val_ metrics assumes it holds none")


def log_keys(dp, x, validation_data, callbacks: list) -> training_logs.LogKeys:
    """Which of ``fit``'s logged keys are private (:class:`~sparta_tf.dp_model.training_logs.LogKeys`): the
    validation metrics too when ``validation_data`` holds a training example. Validation data that cannot be
    checked (a dataset) is recorded as a ledger caveat when a callback acts on a validation metric."""
    holds = training_logs.validation_holds_training_examples(x, validation_data)
    keys = training_logs.LogKeys(validation_holds_training_examples=bool(holds))
    if holds is None and validation_data is not None and dp.ledger is not None:
        every_metric = training_logs.LogKeys(validation_holds_training_examples=True)
        if len(training_logs.acting_reasons(callbacks, every_metric)) > len(training_logs.acting_reasons(callbacks,
                                                                                                      keys)):
            dp.ledger.record_caveat(UNCHECKED_VALIDATION)
    return keys


def check_ledger_unit(dp) -> None:
    """One line when the model's ledger protects another unit than its steps (a ledger restored from a run at
    the other unit): its epsilon would be claimed for one user while the steps sample examples, or the
    reverse."""
    if dp.ledger is not None and dp.ledger.unit != dp.unit:
        raise ValueError(f"the ledger protects one {dp.ledger.unit} but this model's DP steps protect one {dp.unit}; "
                         f"restore a ledger of a run at unit={dp.unit!r}, or make the model with "
                         f"unit={dp.ledger.unit!r}")


def check_users_argument(dp, dataset: bool, users) -> None:
    """One line when ``users`` does not match the model's unit: user ids without ``unit="user"``, none
    with it, or a ``tf.data.Dataset`` with it (user sampling is built from arrays and their ids)."""
    if dp.unit == "example":
        if users is not None:
            raise ValueError("fit(users=...) needs a model with unit='user' (user-level DP); pass unit='user' to "
                             "make_private or DPModel, or leave users out for example-level DP")
        return
    if dataset:
        raise ValueError("unit='user' samples users from arrays: pass fit(x, y, users=ids) with in-memory arrays, "
                         "not a tf.data.Dataset")
    if users is None:
        raise ValueError("unit='user' needs each example's user: pass fit(x, y, users=ids), one id per example")


def check_first_padding_mask(element) -> None:
    """One line when a dataset's first ``element`` has weights other than 0 and 1 (the later ones are
    checked as they are read, :func:`checked_padding_mask`)."""
    _, _, weights = tf.keras.utils.unpack_x_y_sample_weight(element)
    if weights is None:
        return
    values = np.unique(np.asarray(weights))
    other = values[(values != 0) & (values != 1)]
    if other.size:
        raise ValueError(f"the dataset's sample weights include {other[0]:g}: {PADDING_MASK_ONLY}; drop the "
                         "weights, or feed arrays to fit")


def check_keras_callbacks(dp, callbacks: list, keys: training_logs.LogKeys = training_logs.LogKeys()) -> None:
    """The Keras callbacks a DP ``fit`` cannot honour, refused before the first step:

    * ``BackupAndRestore`` whose directory holds the backup of an interrupted ``fit``: restoring it would
      train on without charging the steps that ``fit`` ran (``make_private(run_dir=...)`` resumes a
      killed run and charges them). With nothing to restore it backs up and deletes as usual;
    * ``EarlyStopping(restore_best_weights=True)`` with weight averaging that keeps the averages: after
      training both would set the weights;
    * a whole-model ``ModelCheckpoint`` of a model Keras cannot serialize (a subclassed model without
      ``get_config``, which Keras 3 refuses to save): it would fail at the end of the first epoch,
      after that epoch's epsilon was spent.

    A callback that acts on a training metric (``EarlyStopping``, ``ReduceLROnPlateau`` or a best-only
    ``ModelCheckpoint`` monitoring ``loss`` or another metric without ``val_``, or a validation metric when the
    validation data holds training examples: ``keys``) feeds a noiseless statistic of the private batches into
    the released weights: the run is marked not private (:func:`~sparta_tf.dp_model.training_logs.acting_reasons`)."""
    for reason in training_logs.acting_reasons(callbacks, keys):
        if dp.ledger is not None and reason not in dp.ledger.nonprivate_reasons:
            dp.ledger.record_nonprivate(reason)
            warnings.warn(reason, stacklevel=4)
    for callback in callbacks:
        if isinstance(callback, tf.keras.callbacks.ModelCheckpoint) and not callback.save_weights_only:
            check_serializable(dp.model, f"ModelCheckpoint({str(callback.filepath)!r})")
        backup_dir = getattr(callback, "backup_dir", None)
        if isinstance(callback, tf.keras.callbacks.BackupAndRestore) and backup_dir and _holds_files(backup_dir):
            raise ValueError(
                f"BackupAndRestore: {backup_dir} holds the backup of an interrupted fit, and restoring it would not "
                "charge the steps that fit ran to the ledger; resume a DP run with make_private(run_dir=...) "
                f"instead, or delete {backup_dir} to start afresh")
        if (isinstance(callback, tf.keras.callbacks.EarlyStopping) and callback.restore_best_weights
                and dp.weight_average is not None and dp._use_ema_weights):
            raise ValueError("EarlyStopping(restore_best_weights=True) and ema with use_ema_weights=True would both "
                             "set the weights after training; pass use_ema_weights=False or "
                             "restore_best_weights=False")


BATCH_OUTSIDE_FIT = ("train_on_batch ran a DP step on a batch chosen outside fit's Poisson sampling, which the ledger "
                     "cannot charge (no sampling to amplify it, no pre-step checks); train with fit")


def mark_batch_outside_fit(dp) -> None:
    """``train_on_batch``: the run is marked not private (:data:`BATCH_OUTSIDE_FIT`), with a warning once."""
    if dp.ledger is not None and BATCH_OUTSIDE_FIT not in dp.ledger.nonprivate_reasons:
        dp.ledger.record_nonprivate(BATCH_OUTSIDE_FIT)
        warnings.warn(BATCH_OUTSIDE_FIT, stacklevel=3)


def check_serializable(model: tf.keras.Model, saver: str) -> None:
    """One line when Keras cannot write ``model``'s config (what ``saver``, saving the whole model, needs)."""
    try:
        model.get_config()
    except NotImplementedError:
        raise ValueError(f"{saver} saves the whole model, but {type(model).__name__} has no get_config, so Keras "
                         "cannot save it; pass save_weights_only=True (the weights load into the model you build), "
                         "or give the model a get_config") from None


def _holds_files(directory: str) -> bool:
    return any(files for _, _, files in os.walk(directory))


def prepare(dp, x, y, steps_per_epoch: int | None, first=None, users=None):
    """``(x, y, steps_per_epoch)`` for Keras' ``fit``: arrays become the Poisson (or shuffled)
    dataset of :func:`input_pipeline` from the model's ``dp_step``; a dataset has its padding mask
    checked (:func:`checked_padding_mask`) and its provenance compared with the ledger's charge. Then,
    once per model, the model is probed on a few real examples (of a dataset's ``first`` element,
    :func:`first_element`, whose weights :func:`check_fit_call` checked) and the compiled metrics built."""
    if x is not None and not isinstance(x, tf.data.Dataset):
        if y is None:
            raise ValueError("fit(x, y): labels y are required with array inputs")
        first = first_examples(x), first_examples(y)
        x, steps_per_epoch = input_pipeline(dp, x, y, int(dp.dp_step.numpy()), users)
        y = None
    elif isinstance(x, tf.data.Dataset):
        check_dataset_provenance(dp, x)
        x = x.map(checked_padding_mask)
        first = real_examples(first_element(x) if first is None else first)
    if isinstance(x, tf.data.Dataset):
        probe_model(dp, *first)
        if not dp.built:  # Keras 3's BackupAndRestore refuses an unbuilt model
            dp(first[0], training=False)
        build_compiled_metrics(dp, *first)
        x = distribute.for_fit(x, dp.distribute_strategy)
    return x, y, steps_per_epoch


def input_pipeline(dp, x, y, initial_step: int, users=None):
    """(dataset, steps_per_epoch) for in-memory arrays, Poisson or shuffled (or Poisson over users)."""
    if dp.unit == "user":
        return user_pipeline(dp, x, y, users, initial_step)
    n = len(tf.nest.flatten(x)[0])
    dp.bind_dataset_size(n)  # delta < 1/n is checked there
    extra = 0 if dp.canaries is None else dp.canaries.participants  # a white-box audit's included canaries
    if dp.sampling == "shuffle":
        batch = max(1, round(dp.sample_rate * n))
        dataset = shuffled_dataset(x, y, batch, seed=dp.seed, start_step=initial_step)
        # round(1/q) steps a (Keras) epoch, as the plan and Poisson sampling count them; the permutations run
        # on across epochs (ceil(n / B) batches each), so a planned run is never refused a step it planned
        return dataset, planned_steps_per_epoch(dp.sample_rate)
    if dp.sampling_layout.bands > 1:
        check_same_cyclic_examples(dp, x, y)
    replicas = dp.distribute_strategy.num_replicas_in_sync
    if dp.physical_batch_size is None:
        dp.physical_batch_size = default_physical_batch_size(n, dp.sample_rate, multiple_of=replicas)
    sampler = PoissonSampler(n, dp.sample_rate, dp.physical_batch_size, seed=dp.seed, bands=dp.sampling_layout.bands,
                             extra=extra, plain_steps=dp.sampling_layout.plain)
    if dp.canaries is not None:
        dp.canaries.bind_sampler(sampler)
    return sampler.dataset(x, y, start_step=initial_step), sampler.steps_per_epoch


def check_same_groups(dp, made) -> None:
    """A banded model's dataset from :class:`PoissonSampler` must draw the groups the model's steps assumed: the
    sampler's seed must be the model's (a sampler of another seed, e.g. the default fresh one, draws other
    groups), and its examples those of the model's first fit in its order (:func:`check_same_cyclic_examples`).
    A ValueError, before a step."""
    if made.seed != dp.seed:
        raise ValueError(f"fit got PoissonSampler's dataset drawn with another seed than this model's: its cyclic groups "
                         f"(bands={dp.sampling_layout.bands}) are not the ones the model's correlated noise continues "
                         "with; build the sampler with seed=dp.seed, or feed arrays to fit")
    check_same_cyclic_fingerprint(dp, made.examples)


def check_same_cyclic_examples(dp, x, y) -> None:
    """Cyclic Poisson sampling (``bands > 1``) draws each example's group once per run, by position, and
    the banded noise of the next steps continues across fits and resumes: arrays of other examples, or of
    the same in another order, would move examples to other groups than the earlier steps assumed, so one
    could be sampled twice within ``b`` steps. A ValueError, before a step, unless ``x, y`` are the examples
    of this model's first fit (:attr:`DPModel.cyclic_examples`, restored with a checkpoint) in its order."""
    check_same_cyclic_fingerprint(dp, examples_fingerprint(x, y))


def check_same_cyclic_fingerprint(dp, fingerprint: str) -> None:
    """:func:`check_same_cyclic_examples` for the examples' ``fingerprint``."""
    steps = int(dp.dp_step.numpy())
    if dp.cyclic_examples is None and steps > 0 and dp.private_run is None:  # make_private keeps it
        raise ValueError(f"this model has run {steps} DP steps with bands={dp.sampling_layout.bands} "
                         "but does not know which examples its cyclic groups were drawn for (a model restored from "
                         "checkpoint_state): set dp.cyclic_examples to the value the first run had (save it beside "
                         "the ledger), or resume through make_private(run_dir=...), which keeps it")
    if dp.cyclic_examples is None:
        dp.cyclic_examples = fingerprint
    elif dp.cyclic_examples != fingerprint:
        raise ValueError(f"fit got other examples (or the same in another order) than this model trained on with "
                         f"bands={dp.sampling_layout.bands}: cyclic Poisson sampling drew each example's group by "
                         "position, and its correlated noise continues across fits; pass the same x and y in the "
                         "same order, or train on new data with a new model")


def user_pipeline(dp, x, y, users, initial_step: int):
    """(dataset, steps_per_epoch) of user-level DP (:class:`~sparta_tf.privacy.user_sampling.UserPoissonSampler`):
    ``n`` of the mechanism is the number of users, ``k`` the model's, ``P`` users per micro-batch."""
    if len(np.asarray(users)) != len(tf.nest.flatten(x)[0]):
        raise ValueError(f"users has {len(np.asarray(users))} ids for {len(tf.nest.flatten(x)[0])} examples; pass one "
                         "user id per example of x")
    ids, user_count = dense_user_ids(users)
    dp.bind_dataset_size(user_count)  # delta < 1/U is checked there
    replicas = dp.distribute_strategy.num_replicas_in_sync
    if dp.physical_batch_size is None:  # in users
        dp.physical_batch_size = default_physical_batch_size(user_count, dp.sample_rate, multiple_of=replicas)
    extra = 0 if dp.canaries is None else dp.canaries.participants  # a white-box audit's included canary users
    sampler = UserPoissonSampler(ids, dp.sample_rate, dp.users.examples_per_user,
                                 units_per_batch=dp.physical_batch_size, seed=dp.seed, extra=extra)
    if dp.canaries is not None:
        dp.canaries.bind_sampler(sampler)
    return sampler.dataset(x, y, start_step=initial_step), sampler.steps_per_epoch


def check_dataset_provenance(dp, dataset: tf.data.Dataset) -> None:
    """Records a ledger caveat unless ``dataset`` is, unchanged, what ``PoissonSampler(n, q)
    .dataset`` made for this model's ``n`` and ``q``: the ledger charges Poisson sampling at
    ``q``, which a hand-made or transformed dataset (fixed batches, another rate) need not be.
    With correlated noise (``bands > 1``) such a dataset is refused (a ValueError before a step):
    an example in two steps of one band breaks the band reduction, not only the amplification.
    A ValueError, before a step, for the sampler's dataset of other steps than the model's next
    (one given to a second ``fit``: it would sample the first one's steps again)."""
    if dp.ledger is None or not dp.ledger.covered_by_accountant:
        return  # no accounting, or the ledger already says its sampling is not Poisson
    made = poisson_provenance(dataset)
    layout = dp.sampling_layout
    bands = layout.bands
    expected = (dp.dataset_size, dp.sample_rate)
    next_step = int(dp.dp_step.numpy())
    if made is not None and made.start_step != next_step:
        raise ValueError(f"fit got PoissonSampler's dataset whose first element is step {made.start_step}, but this "
                         f"model's next DP step is {next_step}: its batches would repeat steps already sampled (or "
                         "leave cyclic groups out of step), which the ledger's Poisson analysis does not cover; make a "
                         "new dataset for every fit, sampler.dataset(x, y, start_step=int(dp.dp_step.numpy()))")
    sampled_as_planned = made is not None and (made.sample_rate, made.layout) == (dp.sample_rate, layout)
    if sampled_as_planned and bands > 1:
        check_same_groups(dp, made)
    if sampled_as_planned and dp.dataset_size in (None, made.n):
        return
    what = ("a tf.data.Dataset that PoissonSampler did not make (or one transformed after it)" if made is None
            else f"the dataset of PoissonSampler(n={made.n}, sample_rate={made.sample_rate:g}"
                 f"{made.layout.sampler_arguments()})")
    cyclic = "" if bands == 1 else f" in {bands} cyclic groups"
    plain = "" if not layout.plain else f", plain_steps={list(layout.plain)}"
    caveat = (f"fit got {what}, but the ledger charges Poisson sampling{cyclic} of "
              f"{'the' if expected[0] is None else f'n={expected[0]}'} examples at "
              f"q={expected[1]:g}{plain}; the guarantee holds only if its batches are exactly that; feed arrays to "
              f"fit, or PoissonSampler(n, q, ...{layout.sampler_arguments()}).dataset(x, y) "
              "unchanged")
    if bands > 1:  # other batches break the band reduction itself (participations closer than b), not only amplification
        raise ValueError(caveat.replace("the guarantee holds only if its batches are exactly that",
                                        "with correlated noise other batches are refused"))
    dp.ledger.record_caveat(caveat)
    warnings.warn(caveat, NotPoissonSampledWarning, stacklevel=4)


class NotPoissonSampledWarning(UserWarning):
    """``fit`` got a dataset the ledger's Poisson accounting may not cover (also a caveat in the ledger)."""

def build_compiled_metrics(dp, x, y) -> None:
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
    with dp.distribute_strategy.scope():
        keras_trainer.build_compiled_metrics(dp, lambda: dp.model(x, training=False), y)

def probe_model(dp, x, y) -> None:
    """Before the first DP step, on a few real examples ``x, y`` (no padding), once per model:
    :func:`probe_batch_mixing` (training mode keeps examples apart), :func:`probe_loss_mixing` (so does
    the loss) and
    :func:`~sparta_tf.per_example.coverage.check_coverage` (every trainable variable is seen,
    exactly, by the engine's per-example rules), and that the augmentation of augmentation
    multiplicity takes the inputs. They refuse the model with one line."""
    if dp._model_probed:
        return
    everything = TrainableSet.of_variables(dp.model.trainable_variables)
    engine = make_engine(dp.model, everything, dp.engine_name)  # refuses what it cannot plan
    probe_batch_mixing(dp.model, x)
    if dp.views is not None:
        dp.views.check(x)
    if dp._per_example_loss is not None:
        probe_loss_mixing(dp._per_example_loss, dp.model, x, y)
        check_coverage(engine, x, y, dp._per_example_loss, dp.distribute_strategy)
    dp._model_probed = True

def real_examples(element):
    """``(x, y)``: the real examples (weight 1) of a dataset ``element``."""
    x, y, weights = tf.keras.utils.unpack_x_y_sample_weight(element)
    if weights is None:
        return x, y
    rows = tf.where(tf.reshape(weights, [-1]) > 0)[:, 0]
    pick = lambda t: tf.gather(t, rows)  # noqa: E731
    return tf.nest.map_structure(pick, x), (None if y is None else tf.nest.map_structure(pick, y))


def checked_padding_mask(*element):
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


def fit_callbacks(privacy, callbacks: list, verbose, non_finite, units: str = "examples") -> list:
    """``fit``'s callbacks: the model's privacy callback first (None: no ledger), the report of the
    examples each epoch dropped (``non_finite``: the model's :class:`~sparta_tf.dp_step.usable_examples.
    NonFiniteExamples`), and a per-step progress bar last (after the privacy callback, so that it shows
    epsilon) unless one is given; ``units``: what the DP step's units are ("examples" or "users")."""
    callbacks = [*([privacy] if privacy is not None else []), *callbacks,
                 DroppedExamplesReport(non_finite, units)]
    if verbose != 0 and not any(isinstance(c, tf.keras.callbacks.ProgbarLogger) for c in callbacks):
        callbacks.append(keras_trainer.step_progress_bar())
    return callbacks


def symbolic_build_batch(dp, iterator, data_batch):
    """``(iterator, data_batch)`` for Keras 3's ``_maybe_symbolic_build``: Keras averages ``fit``'s
    first batch over the replicas with ``strategy.reduce``, which fails for an ``(x, y, w)`` tuple
    across several workers; the first local replica's part has the same shapes and dtypes
    (:func:`distribute.local_batch`)."""
    if iterator is not None and distribute.is_multi_worker(dp.distribute_strategy):
        for _, _, batches in iterator:
            return None, distribute.local_batch(next(batches))
        return None, data_batch
    return iterator, data_batch


def all_weighted(metrics, weighted_metrics):
    """``metrics`` and ``weighted_metrics`` of ``compile`` as one weighted list (see ``DPModel.compile``)."""
    if metrics is None or weighted_metrics is None:
        return weighted_metrics if metrics is None else metrics
    if isinstance(metrics, (list, tuple)) and isinstance(weighted_metrics, (list, tuple)):
        return list(metrics) + list(weighted_metrics)
    raise ValueError("DPModel.compile weighs every metric by the padding mask: pass per-output metrics "
                     "in one argument, `metrics` or `weighted_metrics`, not both")
