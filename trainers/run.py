"""One ``sparta-train`` run: data -> (pre-training) -> model -> method -> DP training -> outputs.

Outputs in ``output_dir``: ``config.json`` (the validated config),
``pretrained.keras`` (when pre-training), ``plan.json``, ``ledger.json``,
``mask/`` (sparse methods), ``tensorboard/``, ``checkpoints/`` (every epoch,
resumable), ``results.json`` and ``export/<version>/`` (TF Serving SavedModel).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import sparta_tf
from sparta_tf import methods
from sparta_tf.privacy import PrivacyCallback, PrivacyLedger
from trainers import checkpointing, external_methods
from trainers.config import ConfigError, check_against_data
from trainers.plan import Plan, make_plan

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RESULTS = "results.json"


# ----------------------------------------------------------------- building blocks


def load_private_data(config: dict):
    from sparta_tf.data import load_dataset

    dataset = load_dataset(config["data"], seed=_seed(config))
    check_against_data(config, len(dataset.x_train))
    return dataset


def _seed(config: dict) -> int:
    seed = config["training"]["seed"]
    return 0 if seed is None else seed


def pretrain(config: dict, input_shape, output_dir: str) -> tf.keras.Model:
    """Non-private pre-training on the public data (cached in ``pretrained.keras``)."""
    from sparta_tf.data import load_dataset, make_augmenter
    from sparta_tf.models.zoo import build_model

    spec = config["pretrain"]
    path = spec["checkpoint"] or os.path.join(output_dir, "pretrained.keras")
    if os.path.exists(path):
        print(f"== pre-trained model: {path}")
        return tf.keras.models.load_model(path, compile=False)
    if spec["data"] is None:
        raise ConfigError("pretrain.data is required when pretrain.enabled is true (the public data set)")
    public = load_dataset(spec["data"], seed=_seed(config))
    print(f"== non-private pre-training on public data {public.name} (n={len(public.x_train)})")
    model = build_model(config["model"], public.num_classes, public.input_shape)
    optimizer = (tf.keras.optimizers.Adam(spec["learning_rate"]) if spec["optimizer"] == "adam"
                 else tf.keras.optimizers.SGD(spec["learning_rate"], momentum=0.9))
    x = public.x_train
    inputs = tf.keras.Input(public.input_shape)
    trainer = model
    if spec["augment"]:
        trainer = tf.keras.Model(inputs, model(make_augmenter(seed=_seed(config))(inputs)))
    trainer.compile(optimizer, loss=LOSS, metrics=["accuracy"])
    trainer.fit(x, public.y_train, epochs=spec["epochs"], batch_size=spec["batch_size"],
                validation_data=(public.x_test, public.y_test), verbose=2)
    tmp = path + ".tmp.keras"
    model.save(tmp)
    os.replace(tmp, path)
    return model


def build_private_model(config: dict, dataset, output_dir: str) -> tf.keras.Model:
    from sparta_tf.models.convert import with_fresh_head
    from sparta_tf.models.zoo import build_model

    if config["pretrain"]["enabled"]:
        base = pretrain(config, dataset.input_shape, output_dir)
        return with_fresh_head(base, dataset.num_classes)
    return build_model(config["model"], dataset.num_classes, dataset.input_shape)


def phase_sizes(config: dict, model: tf.keras.Model) -> list[tuple[str, int, int | None]]:
    """``(phase, epochs, trainable coordinates)`` of the configured method."""
    method, epochs = config["method"], config["training"]["epochs"]
    spec = methods.method_spec(method["name"])
    if spec.selection == "epoch":
        warmup = method["warmup_epochs"]
        phases = [("warmup", warmup, methods.warmup_set(model).size)] if warmup else []
        sparse = _expected_sparse_size(model, method, spec)
        if method["mask"] is None:
            phases.append(("selection", 1, 0))
            return phases + [("sparse", epochs - warmup - 1, sparse)]
        return phases + [("sparse", epochs - warmup, None)]
    if spec.selection == "external":
        return external_methods.planned_phases(config, model)
    if spec.selection == "two_phase":
        full = method["full_epochs"]
        phases = [("full", full, methods.trainable_set(model, "all").size)] if full else []
        return phases + [("bias_terms", epochs - full, methods.bias_terms_set(model).size)]
    if spec.selection == "static":
        from sparta_tf.groups import row_groups
        from sparta_tf.selection import magnitude_selections, random_selections

        groups = row_groups(model)
        granularity = method["granularity"] or spec.granularity
        mask = (magnitude_selections(groups, method["density"], granularity, method["density_overrides"])
                if spec.name == "mp" else
                random_selections(groups, method["density"], granularity, method["seed"], method["density_overrides"]))
        return [(spec.name, epochs, methods.trainable_set(model, spec.name, mask).size)]
    return [(spec.name, epochs, methods.trainable_set(model, spec.name).size)]


def _expected_sparse_size(model: tf.keras.Model, method: dict, spec) -> int:
    """Trainable coordinates after selection: the warm-up set + the kept rows/entries per layer."""
    from sparta_tf.groups import row_groups
    from sparta_tf.selection.topk import density_for, kept_count

    total = methods.warmup_set(model).size
    granularity = method["granularity"] or spec.granularity
    for group in row_groups(model):
        density = density_for(group, method["density"], method["density_overrides"])
        if granularity == "row":
            total += kept_count(group.n_rows, density) * group.row_size
        else:
            total += kept_count(group.n_rows * group.row_size, density)
    return total


def method_callback(config: dict, output_dir: str | None) -> sparta_tf.MethodCallback:
    method, training = config["method"], config["training"]
    head_lr = training["head_learning_rate"] or training["learning_rate"]
    return sparta_tf.MethodCallback(
        method["name"], warmup_epochs=method["warmup_epochs"], density=method["density"],
        score=method["score"], granularity=method["granularity"],
        density_overrides=method["density_overrides"],
        head_learning_rate_scale=head_lr / training["learning_rate"],
        mask_dir=None if output_dir is None else os.path.join(output_dir, "mask"),
        mask=method["mask"], seed=method["seed"], full_epochs=method["full_epochs"],
        bitfit_learning_rate_scale=method["bitfit_learning_rate_scale"],
    )


def make_optimizer(config: dict, total_steps: int) -> tf.keras.optimizers.Optimizer:
    training = config["training"]
    lr = training["learning_rate"]
    if training["schedule"] == "cosine":
        lr = sparta_tf.cosine_with_warmup(lr, total_steps, training["warmup_fraction"])
    decay = training["weight_decay"] or None
    if training["optimizer"] == "adam":
        return tf.keras.optimizers.Adam(lr, weight_decay=decay)
    return tf.keras.optimizers.SGD(lr, momentum=training["momentum"], weight_decay=decay)


# ----------------------------------------------------------------- the run


def dry_run(config: dict) -> Plan:
    dataset = load_private_data(config)
    model = build_model_for_plan(config, dataset)
    plan = _plan(config, len(dataset.x_train), model)
    print(plan.describe())
    return plan


def _plan(config: dict, n: int, model: tf.keras.Model) -> Plan:
    noise_multiplier, prior = external_methods.training_sigma_and_prior(config, n)
    return make_plan(config, n, phase_sizes(config, model), _count(model), noise_multiplier, prior)


def build_model_for_plan(config: dict, dataset) -> tf.keras.Model:
    from sparta_tf.models.zoo import build_model

    return build_model(config["model"], dataset.num_classes, dataset.input_shape)


def _count(model: tf.keras.Model) -> int:
    return int(sum(np.prod(v.shape.as_list()) for v in model.trainable_variables))


def train(config: dict, resume: bool = False, hooks=None) -> dict:
    """Runs one training; ``hooks`` is the seam for ``sparta-audit`` (``trainers.audit``).

    ``hooks``, when given, has ``private_data(dataset) -> dataset`` (applied to
    the loaded private data before the plan and the sample rate are made) and
    ``callbacks() -> list`` (extra Keras callbacks for the DP ``fit``).
    """
    output_dir = config["output_dir"]
    previous = checkpointing.latest(output_dir) if resume else None
    if not resume and os.path.exists(os.path.join(output_dir, RESULTS)):
        raise ConfigError(f"output_dir {output_dir} already holds a finished run; choose a new output_dir "
                          "or pass --resume to continue an interrupted one")
    if resume and previous is None and checkpointing.latest(output_dir) is None:
        print(f"== --resume: no checkpoint in {output_dir}, starting from scratch")
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tf.keras.utils.set_random_seed(_seed(config))
    timings = {}
    start = time.perf_counter()
    dataset = load_private_data(config)
    if hooks is not None:
        dataset = hooks.private_data(dataset)
    model = build_private_model(config, dataset, output_dir)
    timings["prepare_s"] = time.perf_counter() - start
    plan = _plan(config, len(dataset.x_train), model)
    print(plan.describe())
    with open(os.path.join(output_dir, "plan.json"), "w") as f:
        json.dump(plan.to_json(), f, indent=1)

    privacy, training = config["privacy"], config["training"]
    seed = previous[1]["seed"] if previous else (training["seed"] if training["seed"] is not None else None)
    dp_kwargs = dict(
        noise_multiplier=plan.noise_multiplier, clip_norm=privacy["clip_norm"],
        sample_rate=plan.sample_rate, dataset_size=plan.n, physical_batch_size=training["physical_batch_size"],
        sampling=privacy["sampling"], delta=privacy["delta"], target_epsilon=privacy["target_epsilon"],
        accountant=privacy["accountant"], seed=seed, engine=training["engine"], jit_compile=training["jit_compile"],
    )
    external = config["method"]["name"] in external_methods.EXTERNAL
    if external and previous is not None:
        raise ConfigError(f"--resume is not supported for method {config['method']['name']} yet "
                          "(its selection would be charged twice); start a new output_dir")
    dp = (external_methods.build_dp_model(config, model, dp_kwargs) if external
          else sparta_tf.DPModel(model, **dp_kwargs))
    dp.compile(make_optimizer(config, plan.steps), loss=LOSS, metrics=["accuracy"])
    method_info = external_methods.choose_trainable_set(config, dp, dataset, LOSS, plan) if external else {}
    callback = method_callback(config, output_dir)
    initial_epoch = 0
    if previous is not None:
        initial_epoch = _resume(previous, dp, callback, plan, output_dir)
    ledger_path = os.path.join(output_dir, "ledger.json")
    privacy_callback = PrivacyCallback(dp.ledger, plan.noise_multiplier, plan.sample_rate, plan.steps_per_epoch,
                                       step_counter=dp.dp_step, budget_mode="until_exhausted",
                                       on_budget_exhausted=lambda: dp.ledger.save(ledger_path))
    saver = _EpochCheckpoint(output_dir, dp, plan, seed=dp._sampling_seed)
    callbacks = [privacy_callback, callback, checkpointing.StepJournal(output_dir), saver,
                 tf.keras.callbacks.TensorBoard(os.path.join(output_dir, "tensorboard"))]
    callbacks += hooks.callbacks() if hooks is not None else []
    start = time.perf_counter()
    history = dp.fit(dataset.x_train, dataset.y_train, epochs=training["epochs"], initial_epoch=initial_epoch,
                     validation_data=(dataset.x_val, dataset.y_val) if len(dataset.x_val) else None,
                     callbacks=callbacks, verbose=1 if sys.stdout.isatty() else 2)
    timings["train_s"] = time.perf_counter() - start
    dp.ledger.save(ledger_path)
    results = _results(config, dp, plan, dataset, saver.phase_seconds, timings, history) | method_info
    if config["export"]["enabled"]:
        from sparta_tf.export import export_for_serving

        results["export_dir"] = export_for_serving(
            dp.model, os.path.join(output_dir, "export"), version=config["export"]["version"],
            preprocessing={"mean": getattr(dataset, "mean", None), "std": getattr(dataset, "std", None)},
        )
    tmp = os.path.join(output_dir, RESULTS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, os.path.join(output_dir, RESULTS))
    print(dp.ledger.report())
    spent = f"epsilon {results['epsilon']:.4g}" if results["private"] else "NO privacy guarantee (oracle mask)"
    print(f"== test accuracy {results['test_accuracy']:.4f} at {spent} "
          f"(delta {privacy['delta']:g}); results in {os.path.join(output_dir, RESULTS)}")
    return results


def _resume(previous, dp, callback, plan: Plan, output_dir: str) -> int:
    path, state = previous
    epoch = state["epoch"]
    dp.ledger = PrivacyLedger.from_json(state["ledger"])
    dp.ledger.target_epsilon = plan.target_epsilon
    phase = callback.phase_of(epoch)
    callback.model = dp
    callback.params = {"epochs": plan.epochs}
    callback.on_train_begin()
    callback.on_epoch_begin(epoch)  # recreates the trainable set (and optimizer slots) of that phase
    if phase == "selection":
        dp.end_scoring()
    checkpointing.restore(path, dp)
    lost = checkpointing.charge_interrupted_steps(output_dir, int(dp.dp_step.numpy()), dp.ledger,
                                                  plan.noise_multiplier, plan.sample_rate)
    print(f"== resuming after epoch {epoch} from {path}; {lost} step(s) of the interrupted epoch charged "
          f"to the ledger (epsilon so far {dp.ledger.epsilon():.4g})")
    callback.phase = None
    return epoch


class _EpochCheckpoint(tf.keras.callbacks.Callback):
    """Saves a resumable checkpoint and the ledger after every epoch; times phases."""

    def __init__(self, output_dir: str, dp, plan: Plan, seed: int):
        super().__init__()
        self.output_dir, self.dp, self.plan, self.seed = output_dir, dp, plan, seed
        self.phase_seconds: dict[str, float] = {}
        self._start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        phase = self.dp.privacy_callback.phase if self.dp.privacy_callback else None
        phase = phase or "train"
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.perf_counter() - self._start
        if self.dp.privacy_callback is not None:
            self.dp.privacy_callback.flush()
        checkpointing.save(self.output_dir, epoch + 1, self.dp,
                           {"seed": self.seed, "ledger": self.dp.ledger.to_json()})
        self.dp.ledger.save(os.path.join(self.output_dir, "ledger.json"))


def _results(config, dp, plan: Plan, dataset, phase_seconds, timings, history) -> dict:
    test_loss, test_accuracy = dp.evaluate(dataset.x_test, dataset.y_test, verbose=0)[:2]
    return {
        "method": config["method"]["name"],
        "private": dp.ledger.is_private,
        "epsilon": dp.ledger.epsilon() if dp.ledger.is_private else None,  # None: not DP (oracle)
        "target_epsilon": plan.target_epsilon,
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "clip_norm": config["privacy"]["clip_norm"],
        "steps": dp.ledger.steps,
        "epochs": plan.epochs,
        "n": plan.n,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "trainable_fraction": dp.trainable_set.fraction_of(dp.model),
        "seconds_per_phase": phase_seconds,
        **timings,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    }


def _user_errors() -> tuple:
    from sparta_tf.privacy.accounting import PrivacyBudgetExceededError

    errors = [PrivacyBudgetExceededError, FileNotFoundError]
    try:
        from sparta_tf.data import DataError

        errors.append(DataError)
    except ImportError:  # pragma: no cover - data module not installed
        pass
    return tuple(errors)


USER_ERRORS = _user_errors()
