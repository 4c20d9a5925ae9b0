"""One ``sparta-tune`` tuning (:func:`tune`): a random number of ``sparta-train`` runs, the best released.

1. Set-up, before any candidate runs (and before anything is written but ``config.json``): the checks of a
   run, the data (for ``n`` and the validation split's size), a candidate's plan (calibrated by the plan
   with the tuning, :class:`~sparta_tf.privacy.tuning.Repetition`, so that ``RepeatAndSelectDpEvent`` of one
   candidate meets the config's ``privacy.target_epsilon``), the refusal
   of a per-run noise that leaves nothing to learn, then the secret draws (the number of candidates, their
   values and seeds), checked to run one mechanism, and written to ``tuning.json`` atomically. A resumed
   tuning reads them back and never draws again.
2. Each candidate: ``sparta-train``'s run (:func:`trainers.run.train`) of the config with its values and
   the tuned plan, in ``candidates/NNN/`` (resumed there when a kill interrupted
   it: every step it started is charged), then its noisy validation score, recorded in its ledger.
3. The release, in ``release/`` (:mod:`sparta_tf.tuning.release`: written by a fresh process, so that
   no byte of it depends on the number of candidates or the winner's index): the best candidate's model
   (``model.keras``, ``export/``), its values and noisy score in ``results.json``, and ``ledger.json``:
   ``RepeatAndSelectDpEvent`` of the entries that dominate every candidate's (a candidate that ran more
   steps than planned raises it; the planned ones are the floor).

Private (never released): everything in ``output_dir`` but ``release/``: ``tuning.json`` (the seed, the
draws, the split key), ``candidates/``, ``results.json`` (the released results plus what the release
leaves out: the number of candidates, the winner's index, its noiseless test accuracy, the validation
split's size and the score's noise), ``config.json``, the pre-trained model and the log.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from sparta_tf import checkpointing
from sparta_tf.atomic_files import replace_atomically, write_atomic
from sparta_tf.data.loader import KNOWN_KEY_CAVEAT
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.tuning import CandidateCount, Repetition, TuningBudgetError
from sparta_tf.tuning import procedure
from sparta_tf.tuning.release import RELEASE_DIR, write_release
from sparta_tf.tuning.space import corners
from trainers import run, split_key
from trainers.config import ConfigError, validate
from trainers.pretraining import PRETRAINED, check_pretraining
from trainers.run_dir import RESULTS, RunDirectory
from trainers.tuning_config import candidate_config

STATE = "tuning.json"
CANDIDATES = "candidates"
MODEL = "model.keras"
DIVERGED = "diverged.json"
STATE_VERSION = 1


# ----------------------------------------------------------------- set-up (shared with the dry run)


def count_of(config: dict) -> CandidateCount:
    tuning = config["tuning"]
    return CandidateCount(tuning["mean"], tuning["shape"])


def repetition_of(config: dict, validation_size: int) -> Repetition:
    """The tuning around each candidate: the number of candidates' distribution and the score's noise (the
    default from ``validation_size``: the public expected one, which the released ledger's score entry shows)."""
    noise = config["tuning"]["score_noise"] or procedure.default_score_noise(validation_size)
    return Repetition(count_of(config), float(noise))


def per_run_config(config: dict, values: dict | None = None, output_dir: str | None = None,
                   pretrained: str | None = None) -> dict:
    """A candidate's ``sparta-train`` config: ``values`` set, the RDP accountant (the tuning's), its own
    ``output_dir``, the tuning's shared pre-trained model. Its plan is made with the tuning
    (:class:`CandidateHooks`), so its noise is the tuning's."""
    candidate = candidate_config(config, values or {})
    candidate["privacy"] = dict(candidate["privacy"], accountant="rdp")
    if output_dir is not None:
        candidate["output_dir"] = output_dir
    if pretrained is not None and candidate["pretrain"]["enabled"] and not candidate["pretrain"]["checkpoint"]:
        candidate["pretrain"] = dict(candidate["pretrain"], checkpoint=pretrained)
    return validate(candidate)


class Setup:
    """What the set-up finds (the dry run and :func:`tune`): the data, the candidates' plan (every corner of
    the space checked to run its mechanisms) and the untuned run's."""

    def __init__(self, config: dict, data_split_key: int | None = None):
        check_one_process(config)
        run.preflight(config)
        self.config = config
        self.dataset = run.load_private_data(config, data_split_key)
        users = None if config["privacy"]["unit"] == "example" else self.dataset.users_val
        self.validation_size = procedure.validation_units(self.dataset.y_val, users)  # the score's n_val (private)
        try:
            procedure.check_validation_size(self.validation_size)
        except ValueError as error:
            raise ConfigError(f"data.val_fraction: {error}") from None
        training_users = None if users is None else self.dataset.users_train
        self.public_validation_size = procedure.expected_validation_units(  # what the release may depend on
            procedure.validation_units(self.dataset.y_train, training_users), config["data"]["val_fraction"])
        check_pretraining(config, self.dataset, config["output_dir"])
        self.model = run.build_private_model(config, self.dataset, None)
        self.method = run.build_method(config, None, self.model)
        self.repetition = repetition_of(config, self.public_validation_size)
        try:
            self.plan = self.plan_of({})
            self.signal = procedure.check_signal(self.plan)
        except TuningBudgetError as error:
            raise ConfigError(f"tuning: {error}") from None
        self.check_one_mechanism(corners(config["tuning"]["space"]))
        self.untuned = run.make_plan(config, self.dataset, self.method)

    def plan_of(self, values: dict):
        """The plan of a candidate with ``values``, calibrated for the tuning."""
        candidate = per_run_config(self.config, values)
        method = self.method if not values else run.build_method(candidate, None, self.model)
        return procedure.tuned_plan(lambda repetition: run.make_plan(candidate, self.dataset, method, repetition),
                                    self.repetition, self.config["privacy"]["target_epsilon"],
                                    self.config["privacy"]["delta"])

    def describe(self) -> str:
        return "\n".join([
            procedure.describe_tuning(self.plan, self.config["tuning"]["space"], self.validation_size, self.untuned),
            "each candidate's plan:",
            run.describe(self.plan, self.method, self.model, self.config),
        ])

    def check_one_mechanism(self, candidates) -> None:
        """Every candidate (each ``values`` of ``candidates``) runs the reference candidate's mechanisms."""
        try:
            procedure.check_one_mechanism(self.plan, self.plan_of, candidates, "tuning.space")
        except ValueError as error:
            raise ConfigError(str(error)) from None


def check_one_process(config: dict) -> None:
    """A tuning runs its candidates in one process: on several workers each would draw its own candidates,
    seeds and data split, so ``training.strategy: multi_worker`` is refused (one line, before anything runs)."""
    if config["training"]["strategy"] == "multi_worker":
        raise ConfigError("training.strategy: multi_worker is not supported by sparta-tune (each worker would draw its "
                          "own candidates, seeds and data split); set training.strategy to default or mirrored")


def dry_run(config: dict, data_split_key: int | None = None) -> Setup:
    """Every check of the tuning, the per-run budget and the price of tuning printed; writes nothing and
    draws nothing (but a split key when none is given, as :func:`trainers.run.dry_run`)."""
    setup = Setup(config, data_split_key)
    print(setup.describe())
    return setup


# ----------------------------------------------------------------- the tuning


class CandidateHooks:
    """The :func:`trainers.run.train` seam for one candidate: its secret run seed, and its noisy score."""

    run_seed_is_public = False

    def __init__(self, index: int, draws: procedure.Draws, tuning: Repetition, output_dir: str,
                 noise_multiplier: float | None, data_split_key: int | None, score_denominator: float | None = None):
        self.index, self.draws, self.tuning, self.output_dir = index, draws, tuning, output_dir
        self.score_denominator = score_denominator  # None: n_val (a tuning started before it was public)
        self.run_seed = draws.candidates[index].run_seed
        self.public_seed = draws.public_seed(index)
        self.noise_multiplier = noise_multiplier
        self.split_key = data_split_key  # the tuning's: every candidate trains and scores on the same splits

    def check_plan(self, plan) -> None:
        """The candidate runs the noise the tuning planned (a tuning resumed by another version of sparta-tune
        could calibrate another, and two noises would cost twice)."""
        if self.noise_multiplier is not None and abs(plan.noise_multiplier - self.noise_multiplier) > \
                1e-9 * self.noise_multiplier:
            raise ConfigError(f"--resume: this candidate would train with noise multiplier {plan.noise_multiplier:.6g}, "
                              f"the tuning planned {self.noise_multiplier:.6g}; resume it with the sparta-tune version "
                              "that started it")

    def private_data(self, dataset):
        return dataset

    def callbacks(self) -> list:
        return []

    def after_fit(self, dp, dataset) -> dict:
        users = None if dp.unit == "example" else dataset.users_val
        score = procedure.score_candidate(dp, dataset.x_val, dataset.y_val, self.draws, self.index,
                                          self.tuning.score_noise, users, self.score_denominator)
        replace_atomically(os.path.join(self.output_dir, MODEL), dp.model.save, suffix=".keras")
        preprocessing = run.serving_preprocessing(dataset)  # JSON-ready: results.json holds it
        if preprocessing is not None:
            preprocessing = {key: np.asarray(value).tolist() for key, value in preprocessing.items()}
        return {"tuning_score": score, "serving_preprocessing": preprocessing}


def tune(config: dict, resume: bool = False) -> dict:
    """Runs (or with ``resume`` continues) the configured tuning; returns the released ``results.json``."""
    check_one_process(config)
    run.apply_process_settings(config)
    output_dir = config["output_dir"]
    with RunDirectory(output_dir, config, resume) as run_dir:
        state_path = os.path.join(output_dir, STATE)
        if os.path.exists(state_path) and not resume:
            raise ConfigError(f"output_dir {output_dir} holds an interrupted tuning; pass --resume to continue it, "
                              "or choose a new output_dir")
        if os.path.exists(state_path):
            state = _load_state(state_path, config)
        else:
            if resume:
                print(f"== --resume: no tuning in {output_dir}, starting from scratch")
            run_dir.write_config()
            state = _set_up(config, state_path)
        return _run(config, state)


def _set_up(config: dict, state_path: str) -> dict:
    data_split_key = split_key.new_key(config)
    setup = dry_run(config, data_split_key)
    draws = procedure.Draws.draw(setup.repetition.count, config["tuning"]["space"], config["tuning"]["seed"])
    setup.check_one_mechanism([candidate.values for candidate in draws.candidates])
    state = {"version": STATE_VERSION, "config": _sections(config), "draws": draws.to_json(),
             "per_run_epsilon": setup.plan.epsilon, "score_noise": setup.repetition.score_noise,
             "noise_multiplier": setup.plan.noise_multiplier,
             "planned_entries": [e.to_dict() for e in procedure.planned_entries(setup.plan)],
             "validation_size": setup.validation_size, "score_denominator": setup.public_validation_size,
             "split_key": data_split_key}
    write_atomic(state_path, json.dumps(state, indent=1))  # before the first candidate starts
    return state


def _sections(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("notes", "output_dir")}


def _load_state(path: str, config: dict) -> dict:
    with open(path) as f:
        state = json.load(f)
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"{path} was written by another version of sparta-tune; start a new output_dir")
    state["config"]["data"] = split_key.recorded_data(state["config"]["data"])
    if state["config"] != json.loads(json.dumps(_sections(config))):
        raise ConfigError(f"--resume: the tuning in {os.path.dirname(path)} was started with another config; resume "
                          "it with the config it was started with")
    return state


def _run(config: dict, state: dict) -> dict:
    from sparta_tf.privacy.ledger import LedgerEntry

    output_dir = config["output_dir"]
    draws = procedure.Draws.from_json(state["draws"])
    total = len(draws.candidates)
    print(f"== tuning: {total} candidate run(s) (secret: keep this log and {output_dir} private)")
    tally = procedure.Tally([LedgerEntry.from_dict(e) for e in state["planned_entries"]], config["privacy"]["unit"])
    for index, candidate in enumerate(draws.candidates):
        candidate_dir = os.path.join(output_dir, CANDIDATES, f"{index:03d}")
        print(f"== candidate {index + 1} of {total}: {candidate.values}")
        tf.keras.backend.clear_session()  # every candidate's model gets the names the first would: none counts
        results = _candidate(config, state, draws, index, candidate_dir)
        ledger_path = os.path.join(candidate_dir, checkpointing.LEDGER)
        if results is None:  # diverged: it ranks last, and what it ran is charged
            tally.add(None, PrivacyLedger.load(ledger_path) if os.path.exists(ledger_path) else None)
            continue
        tally.add(results["tuning_score"], PrivacyLedger.load(ledger_path))
    tf.keras.backend.clear_session()
    return _release(config, state, draws, tally)


def _candidate(config: dict, state: dict, draws, index: int, candidate_dir: str) -> dict | None:
    """The candidate's ``results.json`` (training it, or resuming it, first); None when it diverged."""
    from sparta_tf.callbacks import NonFiniteTrainingError

    results_path = os.path.join(candidate_dir, RESULTS)
    if os.path.exists(os.path.join(candidate_dir, DIVERGED)):
        return None
    if not os.path.exists(results_path):
        candidate_config_ = per_run_config(config, draws.candidates[index].values, candidate_dir,
                                           os.path.join(config["output_dir"], PRETRAINED))
        hooks = CandidateHooks(index, draws, Repetition(draws.count, state["score_noise"]), candidate_dir,
                               state.get("noise_multiplier"), state.get("split_key"),
                               state.get("score_denominator", state["validation_size"]))  # a tuning's every candidate
        try:
            run.train(candidate_config_, resume=os.path.isdir(candidate_dir), hooks=hooks)
        except NonFiniteTrainingError as error:
            write_atomic(os.path.join(candidate_dir, DIVERGED), json.dumps({"error": str(error)}))
            print(f"== candidate {index + 1} diverged ({error}); it ranks last")
            return None
    with open(results_path) as f:
        return json.load(f)


def release_caveats(config: dict, state: dict) -> list[str]:
    """What the tuning's own set-up leaves uncovered, beyond its candidates' caveats: a split key that
    ``training.seed`` decides (the candidates' run seeds are secret, so no run states it), and a tuning
    started before the score's denominator was public (its noise and score reveal ``n_val``)."""
    caveats = []
    if split_key.seed_key(config) is not None:
        caveats.append(KNOWN_KEY_CAVEAT.format(where="derived from training.seed"))
    if "score_denominator" not in state:
        caveats.append(procedure.VALIDATION_SIZE_CAVEAT)
    return caveats


def _release(config: dict, state: dict, draws, tally: procedure.Tally) -> dict:
    """Writes ``release/`` (:func:`~sparta_tf.tuning.release.write_release`) and the private ``results.json``
    (the released results plus what the release leaves out); returns the latter."""
    output_dir = config["output_dir"]
    privacy = config["privacy"]
    for caveat in release_caveats(config, state):
        tally.record_caveat(caveat)
    ledger = tally.released_ledger(draws, delta=privacy["delta"], target_epsilon=privacy["target_epsilon"],
                                   sampling=privacy["sampling"])
    best = tally.best
    results = {"released": best is not None, "method": config["method"]["name"], "private": ledger.is_private,
               "unit": ledger.unit,
               "epsilon": ledger.epsilon() if ledger.is_private else None, "target_epsilon": privacy["target_epsilon"],
               "delta": privacy["delta"], "accountant": ledger.accountant, "tuning": draws.count.to_dict(),
               "per_run_epsilon": state["per_run_epsilon"], "privacy_caveats": ledger.caveats()}
    private = {"candidates": len(draws.candidates), "winner": best, "score_noise": state["score_noise"],
               "validation_size": state["validation_size"]}
    model_path = export_version = preprocessing = None
    if best is None:
        results["reason"] = "no candidate finished with a score (none drawn, or every one diverged)"
    else:
        best_dir = os.path.join(output_dir, CANDIDATES, f"{best:03d}")
        with open(os.path.join(best_dir, RESULTS)) as f:
            chosen = json.load(f)
        results |= {"hyperparameters": draws.candidates[best].values, "validation_score": chosen["tuning_score"],
                    "noise_multiplier": chosen["noise_multiplier"]}
        private |= {k: v for k, v in chosen.items() if k.startswith("test_accuracy") or k == "test_weights"}
        model_path = os.path.join(best_dir, MODEL)
        if chosen.get("export_dir"):
            # the configured version, else 1: not the candidate's own number, which a candidate killed after
            # its export and resumed would have raised (telling which candidate won, and that it was resumed)
            export_version = config["export"]["version"] if config["export"]["version"] is not None else 1
            preprocessing = chosen.get("serving_preprocessing")
    release_dir = write_release(os.path.join(output_dir, RELEASE_DIR), results, ledger.to_json(), model_path,
                                export_version, preprocessing)
    everything = results | {"release_dir": release_dir, "not_released": private}
    write_atomic(os.path.join(output_dir, RESULTS), json.dumps(everything, indent=1))
    print(ledger.report())
    spent = f"epsilon {results['epsilon']:.4g}" if results["private"] else "NO privacy guarantee"
    if best is None:
        print(f"== nothing released: {results['reason']}; the tuning spent {spent}")
    else:
        print(f"== released the best candidate: {results['hyperparameters']}, noisy validation accuracy "
              f"{results['validation_score']:.4f} at {spent} (delta {privacy['delta']:g}); the release is "
              f"{release_dir}")
        print(f"== private (keep it with the data): candidate {best + 1} of {len(draws.candidates)} won, test accuracy "
              f"{private.get('test_accuracy', float('nan')):.4f}; {os.path.join(output_dir, RESULTS)} holds it")
    return everything
