"""One ``sparta-train`` run (:func:`train`), as ``_train`` runs it:

1. ``config.json`` is written; the data seed is set; :func:`preflight` checks the model section, the
   public data (no examples shared with the private data) and the output directory;
2. the private data is loaded (``sparta-audit``'s hook may plant canaries in it);
3. the model: pre-trained on public data, or loaded from ``pretrain.checkpoint`` / the cache, with a
   fresh head (:mod:`trainers.pretraining`), or built from the zoo;
4. the method (:func:`sparta_tf.methods.make_method`, checked against the model) and the
   :class:`~sparta_tf.privacy.plan.PrivacyPlan` (:func:`sparta_tf.private_training.plan_method`, with
   the data's reasons a run is not private): printed as ``--dry-run`` prints it, saved as ``plan.json``;
5. the DP model built from the plan (:func:`sparta_tf.private_training.private_model`: its one
   mechanism, a ledger holding the plan's non-private reasons; from ``output_dir``'s last checkpoint
   when resuming), compiled with an optimizer whose schedule spans the plan's update steps; a fresh
   run's ledger also records the config's and the data's caveats;
6. ``dp.fit`` runs the method's phases, journals every step, charges the steps of a killed run and
   checkpoints every epoch (:mod:`sparta_tf.private_training`, :mod:`sparta_tf.privacy.charging`);
7. ``ledger.json``, ``results.json`` (:mod:`trainers.results`) and, when enabled, the export.

Outputs in ``output_dir`` (owned by one process, :mod:`trainers.run_dir`): ``config.json``,
``pretrained.keras`` and ``pretrained.json`` (when pre-training; see :mod:`trainers.pretraining`),
``plan.json``, ``ledger.json``, ``mask/`` (methods with a mask or a choice made before training),
``tensorboard/``, ``checkpoints/`` (every epoch, resumable), ``results.json`` and
``export/<version>/`` (TF Serving SavedModel).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import sparta_tf
from sparta_tf import checkpointing, choices, determinism, distribute
from sparta_tf.methods import Method, make_method
from sparta_tf.per_example import memory_budget
from sparta_tf.dp_step.correlated_noise import noise_buffer_bytes
from sparta_tf.privacy.sampling import default_physical_batch_size
from sparta_tf.private_training import plan_method, private_model
from sparta_tf.privacy.plan import FixedNoiseOverBudgetError, PrivacyPlan
from trainers.config import ConfigError, check_against_data
from trainers.pretraining import LOSS, check_pretraining, data_seed, load_pretrained, pretrain
from trainers.results import run_results
from trainers import split_key as split_keys
from trainers.run_dir import RESULTS, RunDirectory, check_output_dir

# ----------------------------------------------------------------- building blocks


def preflight(config: dict) -> None:
    """What the dry run and the run check before loading data: the model section (the zoo's own
    validation), the public data spec, the pre-training checkpoint and the output directory."""
    from sparta_tf.data import DataError, parse_spec
    from sparta_tf.data.spec import may_share_examples
    from sparta_tf.models.zoo import validate_model_spec

    try:
        validate_model_spec(config["model"])
    except ValueError as error:
        raise ConfigError(str(error)) from None
    spec = config["pretrain"]
    if spec["enabled"] and spec["data"] is not None:
        try:
            public = parse_spec(spec["data"])
        except DataError as error:
            raise DataError(str(error.under("pretrain.data"))) from None
        if may_share_examples(public, parse_spec(config["data"])):
            raise ConfigError("pretrain.data reads the private data's examples (same source and file, overlapping "
                              "classes): non-private pre-training on them voids the guarantee; pre-train on public "
                              "data (other files or disjoint classes)")
    checkpoint = spec["checkpoint"] if spec["enabled"] else None
    if checkpoint and not os.path.exists(checkpoint) and spec["data"] is None:
        raise ConfigError(f"pretrain.checkpoint={checkpoint!r} does not exist and there is no pretrain.data to "
                          "make it; fix the path or give the public data")
    if checkpoint and os.path.exists(checkpoint):
        load_pretrained(checkpoint, "pretrain.checkpoint")
    check_output_dir(config["output_dir"])


def load_private_data(config: dict, split_key: int | None = None):
    """The private data set, its held-out splits keyed by ``split_key`` (:mod:`trainers.split_key`; None: a
    fresh secret key when the config needs one, as a dry run draws)."""
    from sparta_tf.data import load_dataset

    split_key = split_key if split_key is not None else split_keys.new_key(config)
    dataset = load_dataset(config["data"], seed=data_seed(config), split_key=split_key)
    check_against_data(config, private_units(config, dataset))
    return dataset


def private_units(config: dict, dataset) -> int:
    """``n`` of the mechanism: the training examples, or with ``privacy.unit: user`` the training users."""
    return len(dataset.x_train) if config["privacy"]["unit"] == "example" else dataset.user_count


def examples_per_user(config: dict) -> int:
    """``k`` of a user-level run: ``privacy.examples_per_user``, else the constant default
    (:data:`~sparta_tf.privacy.user_sampling.DEFAULT_EXAMPLES_PER_USER`); 1 at example level."""
    from sparta_tf.privacy.user_sampling import DEFAULT_EXAMPLES_PER_USER

    if config["privacy"]["unit"] == "example":
        return 1
    return config["privacy"]["examples_per_user"] or DEFAULT_EXAMPLES_PER_USER


def unit_line(config: dict, dataset, plan: PrivacyPlan) -> str | None:
    """The dry run's lines on the privacy unit (user level): the users, the cap ``k`` and the share of the
    examples it leaves out of every step, and what an example-level run would claim for a person (group
    privacy); None at example level."""
    from sparta_tf.privacy.group_privacy import describe_group_guarantee
    from sparta_tf.privacy.user_sampling import share_left_out

    if plan.unit == "example":
        return None
    sizes = np.unique(dataset.users_train, return_counts=True)[1]
    k = examples_per_user(config)
    left_out = share_left_out(sizes, k)
    chosen = "" if config["privacy"]["examples_per_user"] else " (the default)"
    median = int(np.median(sizes))
    lines = [f"users: {len(sizes)} in the training split, {sizes.sum()} examples (per user: min {sizes.min()}, "
             f"median {median}, max {sizes.max()}); examples_per_user k = {k}{chosen}: each step uses "
             f"at most k of a sampled user's examples, leaving out {100 * left_out:.1f}% of the examples"]
    if plan.target_epsilon is not None:
        lines.append(f"this run's (epsilon {plan.target_epsilon:g}, delta {plan.delta:g}) is per user; for comparison, "
                     + describe_group_guarantee(plan.target_epsilon, plan.delta, median)
                     .replace("a person with", "a person with the median"))
    return "\n".join(lines)


SEED_CAVEAT = ("training.seed is set: the DP noise, batches and data splits follow from it, so the guarantee holds only "
               "while this config stays as secret as the data; leave training.seed null (the default) for a "
               "secret seed")


def privacy_caveats(config: dict, dataset, private: bool, seeded: bool | None = None) -> list[str]:
    """What a private run's guarantee assumes beyond the mechanism: a secret config when it fixes the
    seed (``seeded``; default: ``training.seed`` is set), and what the data set assumes
    (:meth:`Dataset.privacy_caveats`); none for a non-private run."""
    if not private:
        return []
    seeded = config["training"]["seed"] is not None if seeded is None else seeded
    return ([SEED_CAVEAT] if seeded else []) + dataset.privacy_caveats()


def _warn_of_caveats(config: dict, dataset, private: bool) -> None:
    """Prints the plan's caveats: :func:`privacy_caveats` and, for a private run, the sampling's (which
    the ledger adds itself, so it is not recorded with the others)."""
    from sparta_tf.privacy.ledger import sampling_caveat

    sampling = sampling_caveat(config["privacy"]["sampling"], planned=True) if private else None
    for caveat in privacy_caveats(config, dataset, private) + ([sampling] if sampling else []):
        print(f"  WARNING: {caveat}")


def build_private_model(config: dict, dataset, output_dir: str | None) -> tf.keras.Model:
    """The model DP fine-tuning starts from: pre-trained with a fresh head, or built from the zoo
    (``output_dir=None``: the dry run, which builds without pre-training)."""
    from sparta_tf.data import DataError
    from sparta_tf.models.convert import with_fresh_head
    from sparta_tf.models.zoo import build_model

    try:
        if config["pretrain"]["enabled"] and output_dir is not None:
            return with_fresh_head(pretrain(config, output_dir, dataset), dataset.num_classes)
        return build_model(config["model"], dataset.num_classes, dataset.input_shape)
    except (ConfigError, DataError):
        raise  # already one line naming the key (as the dry run reports it)
    except (ValueError, TypeError) as error:
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(message if message.startswith(("model", "pretrain")) else f"model: {message}") from None


def build_method(config: dict, output_dir: str | None, model: tf.keras.Model) -> Method:
    """The configured method (its options are the ``method`` section's, see ``sparta_tf.method_spec``), checked
    against ``model`` (e.g. that ``method.mask`` belongs to it)."""
    training = config["training"]
    options = {k: v for k, v in config["method"].items() if k != "name"}
    head_lr = training["head_learning_rate"] or training["learning_rate"]
    try:
        method = make_method(config["method"]["name"], head_learning_rate_scale=head_lr / training["learning_rate"],
                             mask_dir=None if output_dir is None else os.path.join(output_dir, "mask"), **options)
        method.check(model)
    except (ValueError, OSError) as error:
        message = str(error).splitlines()[0]
        if message.startswith("density_overrides"):
            raise ConfigError(f"method.{message}") from None
        key = "method.mask" if config["method"].get("mask") and "mask" in message else "method"
        raise ConfigError(f"{key}: {message}") from None
    return method


def make_plan(config: dict, dataset, method: Method, tuning=None) -> PrivacyPlan:
    """The run's :class:`PrivacyPlan`: the method's phases and mechanisms, the data's privacy status
    (``tuning``: a ``sparta-tune`` candidate's, :class:`~sparta_tf.privacy.tuning.Repetition`)."""
    privacy, training = config["privacy"], config["training"]
    try:
        plan = plan_method(
            method, dataset_size=private_units(config, dataset), batch_size=training["batch_size"],
            epochs=training["epochs"],
            delta=privacy["delta"], target_epsilon=privacy["target_epsilon"], accountant=privacy["accountant"],
            noise_multiplier=privacy["noise_multiplier"], nonprivate_reasons=dataset.nonprivate_reasons(),
            tuning=tuning, bands=privacy["bands"], unit=privacy["unit"],
        )
    except FixedNoiseOverBudgetError as error:
        raise ConfigError(f"privacy.noise_multiplier={privacy['noise_multiplier']} spends {error.spent} over the "
                          f"planned run, more than privacy.target_epsilon={privacy['target_epsilon']:g}; raise it, "
                          "or leave it null to calibrate it from the target") from None
    except ValueError as error:
        raise ConfigError(f"privacy: {error}") from None
    return plan


def describe(plan: PrivacyPlan, method: Method, model: tf.keras.Model, config: dict) -> str:
    trainable = {phase.name: method.planned_trainable(phase, model) for phase in method.phases(plan.epochs)}
    lines = [plan.describe(trainable, _count(model)), augmult_line(config, plan)]
    return "\n".join(line for line in lines if line)


def bands_line(config: dict, dataset, method: Method, plan: PrivacyPlan) -> str | None:
    """The dry run's line on correlated noise: the noise on the final weights for each number of bands
    against independent noise, each calibrated to the plan's epsilon (:func:`bands_comparison`); None for
    a plan without a target epsilon or not private."""
    from sparta_tf.privacy.banded_error import describe_comparison

    errors = bands_comparison(config, dataset, method, plan)
    return None if errors is None else describe_comparison(errors, plan.bands)


def bands_comparison(config: dict, dataset, method: Method, plan: PrivacyPlan) -> list | None:
    """:func:`sparta_tf.privacy.banded_error.compare_bands` for the run of ``config``: each number of bands
    the run admits, its calibrated noise multiplier and its noise on the final weights against
    independent noise; None for a plan without a target epsilon, not private, or at user level."""
    if (plan.target_epsilon is None or config["privacy"]["noise_multiplier"] is not None or not plan.private
            or plan.unit == "user"):  # user level runs independent noise only
        return None
    from sparta_tf.privacy.banded_error import compare_bands

    def plan_with_bands(bands: int) -> PrivacyPlan:
        with_bands = dict(config, privacy=dict(config["privacy"], bands=bands))
        try:
            return make_plan(with_bands, dataset, method)
        except ConfigError as error:
            raise ValueError(str(error)) from None

    training = config["training"]
    momentum = training["momentum"] if training["optimizer"] == "sgd" else 0.0
    return compare_bands(plan_with_bands, momentum)


def planned_bands_comparison(config: dict) -> list | None:
    """:func:`bands_comparison` of ``config`` (validated) as its dry run computes it: the data loaded, the
    model built (not pre-trained), the method's phases planned; nothing written."""
    preflight(config)
    dataset = load_private_data(config)
    model = build_private_model(config, dataset, None)
    method = build_method(config, None, model)
    return bands_comparison(config, dataset, method, make_plan(config, dataset, method))


def augmentation_of(config: dict) -> dict | None:
    """The view augmentation of ``training.augmult`` (random flip + pad-and-crop, its options from
    ``training.augmult_flip`` / ``augmult_pad``), None without augmentation multiplicity."""
    training = config["training"]
    if training["augmult"] == 1:
        return None
    return {"flip": training["augmult_flip"], "pad": training["augmult_pad"]}


def augmult_line(config: dict, plan: PrivacyPlan) -> str | None:
    """The dry run's line on augmentation multiplicity (None without it)."""
    training = config["training"]
    if training["augmult"] == 1:
        return None
    from sparta_tf.dp_step.views import AugmentationMultiplicity
    from sparta_tf.privacy.sampling import default_physical_batch_size

    views = AugmentationMultiplicity(training["augmult"], augmentation_of(config), seed=0)
    physical = training["physical_batch_size"] or default_physical_batch_size(plan.n, plan.sample_rate)
    return views.describe(physical)


def make_optimizer(config: dict, schedule_steps: int) -> tf.keras.optimizers.Optimizer:
    """The configured optimizer; a cosine schedule spans ``schedule_steps`` (the plan's update steps)."""
    training = config["training"]
    lr = training["learning_rate"]
    if training["schedule"] == "cosine":
        lr = sparta_tf.cosine_with_warmup(lr, schedule_steps, training["warmup_fraction"])
    decay = training["weight_decay"] or None
    if training["optimizer"] == "adam":
        return tf.keras.optimizers.Adam(lr, weight_decay=decay)
    return tf.keras.optimizers.SGD(lr, momentum=training["momentum"], weight_decay=decay)


def serving_preprocessing(dataset) -> dict | None:
    """The normalisation the export must bake in: the data set's ``mean``/``std``, or None without."""
    if dataset.mean is None:
        return None
    return {"mean": dataset.mean, "std": dataset.std}


def _count(model: tf.keras.Model) -> int:
    return int(sum(np.prod(v.shape.as_list()) for v in model.trainable_variables))


# ----------------------------------------------------------------- the run


def dry_run(config: dict, compare_bands: bool = True) -> PrivacyPlan:
    """Runs every check of the run, loads the data, builds the model (not pre-trained) and prints the
    plan; writes nothing. It fails exactly when the run would fail before its first step.
    ``compare_bands``: also print the noise each number of correlated-noise bands would leave
    (:func:`bands_line`: one calibration per candidate, seconds each; no check of the run depends on it)."""
    preflight(config)
    dataset = load_private_data(config)
    check_pretraining(config, dataset, config["output_dir"])
    model = build_private_model(config, dataset, None)
    method = build_method(config, None, model)
    plan = make_plan(config, dataset, method)
    print(describe(plan, method, model, config))
    units = unit_line(config, dataset, plan)
    if units:
        print(units)
    print(memory_line(config, plan, model, method, examples_per_user(config)))
    bands = bands_line(config, dataset, method, plan) if compare_bands else None
    if bands:
        print(bands)
    _warn_of_caveats(config, dataset, plan.private)
    print(strategy_line(config["training"]["strategy"]))
    return plan


def memory_line(config: dict, plan: PrivacyPlan, model: tf.keras.Model, method: Method,
                rows_per_unit: int = 1) -> str:
    """What a full-DP book-keeping step of ``model`` keeps at the run's physical batch, against
    ``training.max_memory`` less the buffer of correlated noise (``privacy.bands``: ``b - 1`` draws of the
    most trainable coordinates of any phase; all of the model's where a phase chooses them as it runs)
    (:func:`sparta_tf.per_example.memory_budget.describe`). ``rows_per_unit``: ``k`` rows per user at user level.
    """
    training = config["training"]  # the physical batch counts the plan's units (examples or users)
    batch = (training["physical_batch_size"] or default_physical_batch_size(plan.n, plan.sample_rate)) * rows_per_unit
    trainable = [method.planned_trainable(phase, model) for phase in method.phases(plan.epochs)]
    most = max((_count(model) if count is None else count for count in trainable), default=0)
    reserved = noise_buffer_bytes(plan.bands, most)
    return memory_budget.describe(model, batch * training["augmult"], choices.memory_bytes(training["max_memory"]),
                                  reserved)


def strategy_line(name: str) -> str:
    """The plan's line on where training runs; a malformed TF_CONFIG or ``$SPARTA_PEER_TIMEOUT_S`` fails
    here (no connection made)."""
    if name != "multi_worker":
        return f"strategy {name}: one process"
    cluster = distribute.parse_tf_config(os.environ.get("TF_CONFIG"))
    role = "chief" if cluster.is_chief else "worker (writes to its scratch directory)"
    return (f"strategy multi_worker: {cluster.num_workers} workers from TF_CONFIG, this task "
            f"{cluster.task_type}[{cluster.task_index}] = {role}; waits up to {distribute.peer_timeout_s():g} s "
            "for its peers")


def apply_process_settings(config: dict) -> None:
    """The process-wide TensorFlow settings a config asks for (``training.deterministic``: see
    :mod:`sparta_tf.determinism`). Call before any ``tf.function`` is traced; they stay on for the
    rest of the process."""
    if config["training"]["deterministic"]:
        determinism.make_deterministic()


def train(config: dict, resume: bool = False, hooks=None) -> dict:
    """Runs (or with ``resume`` continues) the configured run; returns ``results.json``'s content.

    ``hooks`` is the seam for ``sparta-audit`` (:mod:`trainers.audit`) and ``sparta-tune``
    (:mod:`trainers.tune`): when given, it has ``private_data(dataset) -> dataset`` (applied to the loaded
    private data before the plan and the sample rate are made) and ``callbacks() -> list`` (extra Keras
    callbacks for the DP ``fit``); optionally ``run_seed``, ``run_seed_is_public`` and ``public_seed`` (the DP
    run's seed instead of ``training.seed``, which then seeds the data streams only; the seed of its public
    streams, None for one independent of the run seed), ``tuning`` (the plan is a tuning
    candidate's), ``check_plan(plan)`` (may refuse the plan before anything runs) and
    ``after_fit(dp, dataset) -> dict`` (called once training ended, before the ledger is saved; its dict joins
    ``results.json``).
    """
    apply_process_settings(config)
    strategy = distribute.make_strategy(config["training"]["strategy"])  # before any other TensorFlow op
    output_dir = distribute.worker_dir(config["output_dir"], strategy)
    with RunDirectory(output_dir, config, resume) as run_dir, strategy.scope():
        return _train(config, run_dir, hooks)


def _train(config: dict, run_dir: RunDirectory, hooks=None) -> dict:
    output_dir = run_dir.path
    run_dir.write_config()
    tf.keras.utils.set_random_seed(data_seed(config))
    timings = {}
    start = time.perf_counter()
    preflight(config)
    split_key = getattr(hooks, "split_key", None)
    if split_key is None:
        strategy = tf.distribute.get_strategy()
        split_key = split_keys.run_split_key(output_dir, config, lambda key: distribute.shared_seed(strategy, key))
    dataset = load_private_data(config, split_key)
    if hooks is not None:
        dataset = hooks.private_data(dataset)
    model = build_private_model(config, dataset, output_dir)
    timings["prepare_s"] = time.perf_counter() - start
    method = build_method(config, output_dir, model)
    plan = make_plan(config, dataset, method, getattr(hooks, "tuning", None))
    if hasattr(hooks, "check_plan"):
        hooks.check_plan(plan)
    print(describe(plan, method, model, config))
    _warn_of_caveats(config, dataset, plan.private)
    print(strategy_line(config["training"]["strategy"]))
    checkpointing.write_atomic(os.path.join(output_dir, "plan.json"), json.dumps(plan.to_json(), indent=1))

    privacy, training = config["privacy"], config["training"]
    seed = getattr(hooks, "run_seed", training["seed"])
    dp = private_model(model, method, plan, run_dir=output_dir, seed=seed,
                       public_seed=getattr(hooks, "public_seed", seed), clip_norm=privacy["clip_norm"],
                       physical_batch_size=training["physical_batch_size"], sampling=privacy["sampling"],
                       engine=training["engine"], max_memory=training["max_memory"],
                       jit_compile=training["jit_compile"],
                       augmult=training["augmult"], augmentation=augmentation_of(config), ema=training["ema"],
                       use_ema_weights=training["use_ema_weights"] if training["ema"] is not None else None,
                       examples_per_user=privacy["examples_per_user"])
    dp.compile(make_optimizer(config, plan.update_steps), loss=LOSS, metrics=["accuracy"])
    if hasattr(hooks, "attach"):
        hooks.attach(dp)  # sparta-audit --white-box: its gradient canaries join the DP step
    if dp.private_run.previous is None:  # a fresh run (RunDirectory refuses a checkpoint without --resume)
        if run_dir.resume:
            print(f"== --resume: no checkpoint in {output_dir}, starting from scratch")
        seeded = getattr(hooks, "run_seed_is_public", training["seed"] is not None)
        for caveat in privacy_caveats(config, dataset, plan.private, seeded=seeded):
            dp.ledger.record_caveat(caveat)  # in the ledger, so a mask chosen now carries it too
    ledger_path = os.path.join(output_dir, checkpointing.LEDGER)
    callbacks = [sparta_tf.NonFiniteGuard(), tf.keras.callbacks.TensorBoard(os.path.join(output_dir, "tensorboard"))]
    callbacks += hooks.callbacks() if hooks is not None else []
    start = time.perf_counter()
    history = dp.fit(dataset.x_train, dataset.y_train, users=None if plan.unit == "example" else dataset.users_train,
                     validation_data=(dataset.x_val, dataset.y_val) if len(dataset.x_val) else None,
                     callbacks=callbacks, verbose=1 if sys.stdout.isatty() else 2,
                     on_budget_exhausted=lambda: dp.ledger.save(ledger_path))
    timings["train_s"] = time.perf_counter() - start
    after_fit = getattr(hooks, "after_fit", None)
    extra = after_fit(dp, dataset) if after_fit is not None else {}
    dp.ledger.save(ledger_path)
    run = dp.private_run
    results = run_results(config, dp, plan, dataset, run.checkpoint.phase_seconds, timings, history) | run.prepare_info
    results |= extra
    if config["export"]["enabled"]:  # by a fresh process: its function names count nothing this one traced
        from sparta_tf.tuning.release import export_in_fresh_process

        version = config["export"]["version"]
        done = None if version is None else os.path.join(output_dir, "export", str(version))
        if done is not None and dp.private_run.previous is not None and os.path.isdir(done):
            # a run killed after its export's rename (atomic: the export is whole) and before results.json:
            # the same final weights, exported in a fresh process, give the same files
            print(f"== the export {done} of this run exists already; kept")
            results["export_dir"] = done
        else:
            results["export_dir"] = export_in_fresh_process(
                dp.model, os.path.join(output_dir, "export"), version=version,
                preprocessing=serving_preprocessing(dataset),
            )
    checkpointing.write_atomic(os.path.join(output_dir, RESULTS), json.dumps(results, indent=1))
    print(dp.ledger.report())
    spent = f"epsilon {results['epsilon']:.4g}" if results["private"] else "NO privacy guarantee"
    print(f"== test accuracy {results['test_accuracy']:.4f} at {spent} "
          f"(delta {privacy['delta']:g}); results in {os.path.join(output_dir, RESULTS)}")
    return results


def _user_errors() -> tuple:
    from sparta_tf.callbacks import NonFiniteTrainingError
    from sparta_tf.privacy.accounting import PrivacyBudgetExceededError

    errors = [PrivacyBudgetExceededError, distribute.ClusterError, FileNotFoundError, NonFiniteTrainingError,
              checkpointing.CheckpointError]
    try:
        from sparta_tf.data import DataError

        errors.append(DataError)
    except ImportError:  # pragma: no cover - data module not installed
        pass
    return tuple(errors)


USER_ERRORS = _user_errors()
