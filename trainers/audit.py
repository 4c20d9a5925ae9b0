"""``sparta-audit --config CONFIG [--canaries M] [--canary-kind K] [--score S] [--white-box [--data-canaries [N]]] [--set ...]``.

An empirical privacy audit of one ``sparta-train`` run (Steinke, Nasr and
Jagielski, NeurIPS 2023; see :mod:`sparta_tf.audit`): ``M`` canaries, each
put into the private training set with probability 1/2, one training run
through the normal pipeline (the configured method with its selection
epoch, Poisson sampling, the ledger), then

* the epsilon lower bound from the canaries' scores (``-loss`` of the
  trained model, or the loss drop from the start) at the run's delta with
  95% confidence, next to the epsilon the ledger claims;
* a loss-threshold membership attack on the trained model: AUC and TPR at
  FPR = 1e-3 on the canaries, and the AUC on training vs test examples.

The audit trains in ``<output_dir>/audit`` (``--set output_dir=...`` moves
it), reusing ``<output_dir>/pretrained.keras`` when it exists, without the
serving export, and writes ``audit.json`` there next to the run's
``results.json``. An audit always starts from scratch (no ``--resume``: the
start-of-training losses would be lost). Exit status: 0 when the bound is
consistent with the claim, 3 when it contradicts it, 2 for a config error,
1 for a data or budget error, 130 after Ctrl-C (one line saying what to delete
to start the audit over).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from trainers.config import ConfigError, load_config
from trainers.interrupt import stop_on_ctrl_c
from trainers.quiet import import_tensorflow

AUDIT_JSON = "audit.json"
CANARY_LOSSES = "canary_losses.npz"
# sparta_tf.audit.CANARY_KINDS and SCORES, named here so that arguments are checked before TensorFlow loads
CANARY_KINDS = ("mislabelled", "clean", "noise")
SCORES = ("loss", "loss_drop")
CONTRADICTED = 3
DEFAULT_COUNT = -1
"""``--data-canaries`` without a number: the black-box audit's default count (:func:`default_canaries`)."""
RUN_KEYS = ("method", "private", "target_epsilon", "noise_multiplier", "sample_rate", "steps", "n", "test_accuracy",
            "train_s")
"""What ``audit.json`` repeats of the audited run's ``results.json``."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparta-audit", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set privacy.target_epsilon=2")
    parser.add_argument("--canaries", type=int, default=None,
                        help="number of canaries M (default: 1000, at most half the training set)")
    parser.add_argument("--canary-kind", default="mislabelled", choices=CANARY_KINDS,
                        help="mislabelled (default), clean or noise")
    parser.add_argument("--canary-seed", type=int, default=None,
                        help="seed of the canary streams, printed and written to audit.json (default: drawn from the "
                             "run's public seed, never equal to training.seed, and not shown)")
    parser.add_argument("--score", default="loss", choices=SCORES,
                        help="canary score: loss (-loss of the trained model, default) or loss_drop (start - end)")
    parser.add_argument("--confidence", type=float, default=0.95,
                        help="confidence of the verdict (default 0.95); with --white-box it is split among the bounds "
                             "and the mechanism checks, so a correct mechanism exits 3 with probability at most "
                             "1 - confidence")
    parser.add_argument("--white-box", action="store_true",
                        help="gradient canaries inside the DP step, scored from every step's release, and the "
                             "mechanism's noise and sampling rate checked against the ledger (default: data "
                             "canaries scored by the trained model's loss)")
    parser.add_argument("--data-canaries", type=int, nargs="?", const=DEFAULT_COUNT, default=None, metavar="N",
                        help="with --white-box: also plant N data canaries (--canary-kind, --score; N as for the "
                             "black-box audit when left out) in the same run, and report the black-box bound "
                             "beside the white-box one: two views of one training run")
    parser.add_argument("--canary-variable", default=None, metavar="NAME",
                        help="with --white-box: the trainable variable the gradient canaries live on (its name as "
                             "Keras prints it, e.g. stage3_block3_conv2/kernel); default: the head's kernel")
    return parser.parse_args(argv)


def audit_config(config: dict) -> dict:
    """The config of the audit's training run: ``<output_dir>/audit``, no export, the cached pre-training."""
    config = copy.deepcopy(config)
    parent = config["output_dir"]
    config["output_dir"] = os.path.join(parent, "audit")
    config["export"]["enabled"] = False
    cached = os.path.join(parent, "pretrained.keras")
    if config["pretrain"]["enabled"] and config["pretrain"]["checkpoint"] is None and os.path.exists(cached):
        config["pretrain"]["checkpoint"] = cached
    return config


def default_canaries(n: int, kind: str) -> int:
    """1000 canaries, or half the training set for kinds taken from it."""
    return 1000 if kind == "noise" else min(1000, n // 2)


class _Hooks:
    """The ``trainers.run.train`` seam: plants the canaries, records their losses."""

    def __init__(self, config: dict, count: int | None, kind: str, seed: int, confidence: float,
                 seed_given: bool = True):
        self.config, self.count, self.kind, self.seed, self.confidence = config, count, kind, seed, confidence
        self.seed_given = seed_given
        self.canaries = None
        self.recorder = None
        self.dataset = None

    def private_data(self, dataset):
        from sparta_tf.audit import LossRecorder, ceiling, plant_canaries
        from trainers.config import check_against_data

        count = self.count or default_canaries(len(dataset.y_train), self.kind)
        try:
            planted, self.canaries = plant_canaries(dataset, count, self.kind, self.seed)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        check_against_data(self.config, len(planted.y_train))
        top = ceiling(count, self.config["privacy"]["delta"], self.confidence)
        print(f"== audit: {count} {self.kind} canaries, {int(self.canaries.included.sum())} included "
              f"({seed_line(self.seed, self.seed_given)}); {len(planted.y_train)} private training examples; the "
              f"largest bound {count} canaries can show at delta {self.config['privacy']['delta']:g} and "
              f"{self.confidence:.1%} confidence is {top:.3g}")
        self.recorder = LossRecorder(self.canaries.x, self.canaries.y)
        self.dataset = planted
        return planted

    def callbacks(self) -> list:
        return [self.recorder]


def _train_test_auc(model, dataset, canaries) -> float:
    """Loss-threshold MIA AUC: real training examples (canaries left out) vs the test split."""
    import numpy as np

    from sparta_tf.audit import per_example_loss, roc_auc

    real = np.ones(len(dataset.y_train), bool)
    real[canaries.train_rows] = False
    members = per_example_loss(model, dataset.x_train[real], dataset.y_train[real])
    non_members = per_example_loss(model, dataset.x_test, dataset.y_test)
    return roc_auc(-members, -non_members)


CANARY_SEED_STREAM = "canary_seed"


def default_canary_seed(config: dict) -> int:
    """The canary seed of an audit not given one: a draw of the ``canary_seed`` stream of the run's public seed
    (``training.seed`` when it is set, as :func:`sparta_tf.random_streams.public_seed_of` makes a run's public
    seed; a fresh one when it is null), so a seeded audit is reproducible, yet the canary seed is never the
    run's seed, which also seeds the DP noise and batches. It is not shown (:func:`seed_line`)."""
    from sparta_tf import random_streams

    public = random_streams.public_seed_of(None, config["training"]["seed"])
    public = random_streams.new_seed() if public is None else public
    return int(random_streams.numpy_rng(public, CANARY_SEED_STREAM).integers(0, random_streams.MAX_SEED))


def seed_line(seed: int, given: bool) -> str:
    """How the output names the canary seed: the number when ``--canary-seed`` gave it, else only that it was
    drawn (:func:`default_canary_seed`: with ``training.seed`` set, a function of the run's secret seed)."""
    return f"canary seed {seed}" if given else "canary seed drawn, not shown; --canary-seed N sets one"


def fresh_audit_run(config: dict, seed: int | None) -> tuple[dict, int, bool, str]:
    """``(audit_config(config), the canary seed, whether it was given, its output directory)``: the seed as
    given, else :func:`default_canary_seed`; a ConfigError when the directory already holds an audit (an audit
    cannot be resumed)."""
    from trainers import run

    config = audit_config(config)
    given = seed is not None
    seed = seed if given else default_canary_seed(config)
    output_dir = config["output_dir"]
    if os.path.exists(os.path.join(output_dir, AUDIT_JSON)) or os.path.exists(os.path.join(output_dir, run.RESULTS)):
        raise ConfigError(f"{output_dir} already holds an audit; pass --set output_dir=NEW_DIR "
                          "(the audit trains in NEW_DIR/audit)")
    return config, seed, given, output_dir


def run_audit(config: dict, canaries: int | None = None, kind: str = "mislabelled", seed: int | None = None,
              confidence: float = 0.95, score: str = "loss") -> dict:
    """Trains ``audit_config(config)`` with canaries and returns (and writes) the ``audit.json`` report.

    ``seed``: of the ``canaries`` stream (:mod:`sparta_tf.random_streams`), shown in the output and the
    report; None: :func:`default_canary_seed`, not shown (``canary_seed`` is null)."""
    check_arguments(canaries, kind, score, confidence)
    check_unit(config)
    import_tensorflow()
    from sparta_tf.atomic_files import write_atomic
    from sparta_tf.audit import summary_line
    from trainers import run

    config, seed, given, output_dir = fresh_audit_run(config, seed)
    hooks = _Hooks(config, canaries, kind, seed, confidence, given)
    results = run.train(config, hooks=hooks)
    report = _black_box_report(hooks, results, confidence, score, output_dir)
    path = os.path.join(output_dir, AUDIT_JSON)
    write_atomic(path, json.dumps(report, indent=1))
    print(summary_line(report) + f"; report in {path}")
    return report


def _black_box_report(hooks: _Hooks, results: dict, confidence: float, score: str, output_dir: str) -> dict:
    """The black-box audit of the run ``hooks`` planted data canaries in (its canaries' losses saved beside)."""
    import numpy as np

    from sparta_tf.audit import audit_report

    recorder = hooks.recorder
    report = audit_report(hooks.canaries, recorder.start, recorder.end, delta=results["delta"],
                          epsilon_claimed=results["epsilon"], confidence=confidence, score=score,
                          seed_given=hooks.seed_given)
    report["mia_train_test_auc"] = _train_test_auc(recorder.model.model, hooks.dataset, hooks.canaries)
    report |= {key: results[key] for key in RUN_KEYS}
    np.savez(os.path.join(output_dir, CANARY_LOSSES), included=hooks.canaries.included, labels=hooks.canaries.y,
             loss_start=recorder.start, loss_end=recorder.end)
    return report


class _WhiteBoxHooks:
    """The ``trainers.run.train`` seam of ``--white-box``: the data as they are, gradient canaries in the step."""

    def __init__(self, count: int | None, seed: int, confidence: float, variable: str | None = None,
                 seed_given: bool = True, other_bounds: int = 0):
        self.count, self.seed, self.confidence, self.variable = count, seed, confidence, variable
        self.seed_given, self.other_bounds = seed_given, other_bounds
        self.planted = None
        self.report = None

    def private_data(self, dataset):
        return dataset

    def attach(self, dp) -> None:
        from sparta_tf.audit.white_box_run import plant_gradient_canaries, trainable_variable

        try:
            variable = None if self.variable is None else trainable_variable(dp.model, self.variable)
        except ValueError as error:
            raise ConfigError(f"--canary-variable: {error}") from None
        try:
            self.planted = plant_gradient_canaries(dp, self.count, self.seed, variable)
        except ValueError as error:
            raise ConfigError(f"--canaries: {error}") from None
        canaries = self.planted.canaries
        print(f"== white-box audit: {canaries.count} gradient canaries on {canaries.variable.name}, "
              f"{canaries.participants} included ({seed_line(self.seed, self.seed_given)})")

    def callbacks(self) -> list:
        return [self.planted.recorder]

    def after_fit(self, dp, dataset) -> dict:
        from sparta_tf.audit.white_box_run import white_box_report

        self.report = white_box_report(dp, self.planted, self.confidence, self.other_bounds)
        return {}


class _BothHooks:
    """The seam of ``--white-box --data-canaries``: the data canaries of :class:`_Hooks` in the private data and
    the gradient canaries of :class:`_WhiteBoxHooks` in the DP step, in one run. Each audit's canaries are
    participants the other's bound counts as data: the data canaries are examples (clipped, sampled, noised like
    any), and the gradient canaries' reserved coordinates take nothing from the data canaries but what they take
    from every example. Their coin flips come from streams of their own (``canaries`` and
    ``gradient_canaries``), so each data canary's inclusion is independent of the gradient canaries'."""

    def __init__(self, black_box: _Hooks, white_box: _WhiteBoxHooks):
        self.black_box, self.white_box = black_box, white_box

    def private_data(self, dataset):
        return self.black_box.private_data(dataset)

    def attach(self, dp) -> None:
        self.white_box.attach(dp)

    def callbacks(self) -> list:
        return self.black_box.callbacks() + self.white_box.callbacks()

    def after_fit(self, dp, dataset) -> dict:
        return self.white_box.after_fit(dp, dataset)


def run_white_box_audit(config: dict, canaries: int | None = None, seed: int | None = None,
                        confidence: float = 0.95, variable: str | None = None, data_canaries: int | None = None,
                        kind: str = "mislabelled", score: str = "loss") -> dict:
    """Trains ``audit_config(config)`` with gradient canaries in its DP steps and returns (and writes) the
    ``audit.json`` report (:mod:`sparta_tf.audit.white_box`). With ``data_canaries`` (a count, or
    :data:`DEFAULT_COUNT` for the black-box default) the same run also carries that many data canaries of
    ``kind``, and the report holds the black-box audit of them under ``"black_box"`` (as :func:`run_audit`
    reports it); ``passed`` is then both audits', and the black-box bound takes its share of ``confidence`` beside
    the white-box bounds and checks (:func:`~sparta_tf.audit.white_box.verdict_levels`), so that the verdict
    holds at ``confidence``."""
    check_arguments(canaries, kind, score, confidence)
    data_count = None if data_canaries in (None, DEFAULT_COUNT) else data_canaries
    if data_canaries is not None:
        check_arguments(data_count, kind, score, confidence)
        check_unit(config)
    import_tensorflow()
    from sparta_tf.atomic_files import write_atomic
    from sparta_tf.audit import summary_line
    from sparta_tf.audit.white_box import BOUNDS, describe_audit, verdict_levels
    from trainers import run

    config, seed, given, output_dir = fresh_audit_run(config, seed)
    other_bounds = 0 if data_canaries is None else 1  # the black-box bound shares the verdict's confidence
    white_box = _WhiteBoxHooks(canaries, seed, confidence, variable, given, other_bounds)
    black_box_level = verdict_levels(confidence, BOUNDS + other_bounds).bound
    black_box = (None if data_canaries is None else
                 _Hooks(config, data_count, kind, seed, black_box_level, given))
    results = run.train(config, hooks=white_box if black_box is None else _BothHooks(black_box, white_box))
    audit = white_box.report
    report = {"kind": "white_box", **audit.to_json(),
              "passed": not (audit.contradicts_claim or audit.mismatches)}
    report |= {key: results[key] for key in RUN_KEYS}
    if black_box is not None:
        report["black_box"] = _black_box_report(black_box, results, black_box_level, score, output_dir)
        report["passed"] = report["passed"] and report["black_box"]["passed"] is not False
    path = os.path.join(output_dir, AUDIT_JSON)
    write_atomic(path, json.dumps(report, indent=1))
    if black_box is not None:
        print(f"black box (data canaries): {summary_line(report['black_box'])}")
    print(describe_audit(audit) + f"; report in {path}")
    return report


def check_arguments(canaries: int | None, kind: str, score: str, confidence: float) -> None:
    """Raises :class:`ConfigError` (one line, with the fix) for audit arguments that cannot work."""
    if canaries is not None and canaries < 2:
        raise ConfigError(f"--canaries {canaries} must be >= 2 (e.g. --canaries 500)")
    if kind not in CANARY_KINDS:
        raise ConfigError(f"--canary-kind {kind} is unknown; use one of {', '.join(CANARY_KINDS)}")
    if score not in SCORES:
        raise ConfigError(f"--score {score} is unknown; use one of {', '.join(SCORES)}")
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence {confidence} must be in (0, 1), e.g. 0.95")


def check_unit(config: dict) -> None:
    """One line for a user-level config in the black-box audit: its data canaries are single examples, so it
    would audit a guarantee the run does not claim (``--white-box`` draws canary users)."""
    if config["privacy"]["unit"] != "example":
        raise ConfigError("privacy.unit: user: sparta-audit's data canaries are single examples, so they would audit "
                          "an example-level claim, not this run's per-user one; use --white-box (its gradient "
                          "canaries are users)")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    loaded = {}  # "config": the config, once loaded (what the Ctrl-C line names)
    return stop_on_ctrl_c(lambda: _audit(args, loaded), lambda: interrupted_line(loaded.get("config")))


def _audit(args: argparse.Namespace, loaded: dict) -> int:
    try:
        loaded["config"] = load_config(args.config, args.overrides)  # checked before TensorFlow is imported
        check_arguments(args.canaries, args.canary_kind, args.score, args.confidence)
        if args.data_canaries is not None and not args.white_box:
            raise ConfigError("--data-canaries adds data canaries to a --white-box audit; without --white-box, "
                              "--canaries sets the data canaries")
        if args.white_box:
            report = run_white_box_audit(loaded["config"], args.canaries, args.canary_seed, args.confidence,
                                         args.canary_variable, args.data_canaries, args.canary_kind, args.score)
        else:
            report = run_audit(loaded["config"], args.canaries, args.canary_kind, args.canary_seed, args.confidence,
                               args.score)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - data and budget errors are one line, anything else a traceback
        from trainers.run import USER_ERRORS

        if not isinstance(error, USER_ERRORS):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    return CONTRADICTED if report["passed"] is False else 0


def interrupted_line(config: dict | None) -> str:
    """The one line Ctrl-C prints (:mod:`trainers.interrupt`): what stopped and how to start over (an audit
    cannot be resumed: the start-of-training losses of its canaries would be lost)."""
    if config is None:
        return "interrupted: sparta-audit stopped (Ctrl-C) before it read the config; it wrote nothing"
    where = audit_config(config)["output_dir"]
    if not os.path.exists(where):
        return "interrupted: the audit stopped (Ctrl-C) before it wrote anything; run the same command again"
    return (f"interrupted: the audit in {where} stopped (Ctrl-C) and cannot be resumed; delete {where} and run the "
            "same command again to start it over")


if __name__ == "__main__":
    sys.exit(main())
