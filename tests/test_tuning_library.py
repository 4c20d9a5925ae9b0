"""``sparta_tf.tune_privately`` (issue 51): every method tunes on the quickstart data (scikit-learn's digits,
the README's private classes 5-9) and releases one candidate whose ledger is the whole procedure's; the
score reads the validation split only; keys that would change the mechanism are refused."""

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.data import load_dataset
from sparta_tf.methods import METHODS
from sparta_tf.privacy.tuning import CandidateCount, per_run_event, tuning_epsilon
from sparta_tf.tuning import library, procedure

OPTIONS = {"sparta": {"warmup_epochs": 1}, "dpsgd_grad": {"warmup_epochs": 1}, "oracle": {"warmup_epochs": 1},
           "x_bitfit": {"full_epochs": 1}}
SEED = 0  # one candidate at mean 1.5 (geometric); SPARTA's test draws two (seed 4 at mean 2): a selection happens


@pytest.fixture(scope="module")
def digits():
    data = load_dataset({"source": "digits", "classes": [5, 6, 7, 8, 9], "val_fraction": 0.2, "limit_train": 400},
                        seed=0)
    return data


def build_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((8, 8, 1)), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(16, activation="relu", name="d1"),
                                tf.keras.layers.Dense(5, name="head")])


def tune(digits, method="sparta", **kwargs):
    selection = dict(mean=2.0, tuning_seed=4) if method == "sparta" else dict(mean=1.5, tuning_seed=SEED)
    arguments = dict(validation_data=(digits.x_val, digits.y_val), space={"learning_rate": [0.1, 0.5]},
                     target_epsilon=8.0, delta=1e-3, epochs=3, batch_size=64, method=method, **selection,
                     **OPTIONS.get(method, {}))
    arguments.update(kwargs)
    return sparta_tf.tune_privately(build_model, digits.x_train, digits.y_train, **arguments)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_tunes_and_releases_one_candidate(method, digits):
    result = tune(digits, method)
    count = CandidateCount(2.0 if method == "sparta" else 1.5, "geometric")
    assert result.model is not None and result.hyperparameters["learning_rate"] in (0.1, 0.5)
    assert result.model.ledger is result.ledger and result.ledger.tuning == count
    assert 0.0 <= result.score <= 1.0 + 0.2  # a noisy accuracy
    if method == "oracle":  # non-private selection: the tuning says so
        assert not result.ledger.is_private and result.epsilon == np.inf
        return
    assert result.epsilon <= 8.0 * (1 + 1e-9)
    planned = [e for e in result.ledger.entries if e.kind != "tuning_score"]
    assert result.epsilon == pytest.approx(tuning_epsilon(per_run_event(planned, procedure.default_score_noise(
        len(digits.y_val))), count, 1e-3), rel=1e-9)
    assert result.model.evaluate(digits.x_test, digits.y_test, verbose=0) is not None


def test_the_score_reads_the_validation_split_only(digits, monkeypatch):
    seen = []
    original = procedure.count_correct

    def spy(model, x, y, batch_size=256, users=None):
        seen.append((x, y))
        return original(model, x, y, batch_size, users)

    monkeypatch.setattr(procedure, "count_correct", spy)
    tune(digits)
    assert seen and all(x is digits.x_val and y is digits.y_val for x, y in seen)


def test_space_names_that_change_the_mechanism_are_refused(digits):
    for name in ("epochs", "batch_size", "noise_multiplier", "target_epsilon"):
        with pytest.raises(ValueError, match=f"space.{name} would change the privacy mechanism"):
            tune(digits, space={name: [1, 2]})
    with pytest.raises(ValueError, match="validation"):
        tune(digits, validation_data=(digits.x_val[:0], digits.y_val[:0]))


def test_the_tuning_seed_given_is_a_caveat_and_the_default_is_secret(digits, capsys, tmp_path):
    seeded, secret = tune(digits, mean=1.2), tune(digits, mean=1.2, tuning_seed=None)
    assert "phase" not in capsys.readouterr().out  # one set of phase lines per candidate would count them
    assert procedure.SEED_CAVEAT in seeded.ledger.caveats()
    assert procedure.SEED_CAVEAT not in secret.ledger.caveats()
    # the released winner's public streams (a random mask) are never drawn from its secret run seed
    assert seeded.model.public_seed == seeded.model.seed and secret.model.public_seed != secret.model.seed
    for name in ("seed", "public_seed"):
        with pytest.raises(ValueError, match=f"^{name} would give every candidate one seed"):
            tune(digits, mean=1.2, **{name: 3})
    with pytest.raises(ValueError, match="^mask_dir would keep one candidate's mask on disk"):
        tune(digits, mean=1.2, mask_dir=str(tmp_path))  # the last candidate's: it would tell their count
    assert library.default_optimizer().learning_rate.numpy() == pytest.approx(0.1)


def test_a_tuning_with_bands_releases_the_reduction_of_its_candidates(digits):
    """BandMF in a tuning: each candidate runs cyclic Poisson groups and correlated noise; the released
    ledger charges ``ceil(T_p / b)`` runs of ``M_{b q, sigma}`` per gradient phase and one run of
    ``M_{q, sigma}`` per selection step (what each candidate's plan charges)."""
    result = tune(digits, "sparta", bands=2)
    plan = result.model.plan
    assert plan.bands == 2 and result.model.correlated_noise is not None
    (cyclic, plain, score) = result.ledger.entries  # the selection epoch samples every example at q
    assert cyclic.sample_rate == pytest.approx(2 * plan.sample_rate) == pytest.approx(plan.group_sample_rate)
    assert cyclic.compositions == sum(entry.compositions for entry in plan.events() if entry.bands == 2)
    assert cyclic.compositions < plan.update_steps
    assert (plain.sample_rate, plain.compositions) == (plan.sample_rate, plan.steps - plan.update_steps)
    assert result.epsilon <= 8.0 * (1 + 1e-9)


def test_a_public_validation_size_keeps_the_splits_size_out_of_the_release(digits):
    """One validation example fewer: with ``public_validation_size`` the ledgers are identical and the scores
    differ by at most that example's count over m; without it the release carries a caveat."""
    x_val, y_val = digits.x_val, digits.y_val
    m = len(y_val)
    full = tune(digits, mean=1.2, public_validation_size=m)
    fewer = tune(digits, mean=1.2, public_validation_size=m, validation_data=(x_val[1:], y_val[1:]))
    assert [e.to_dict() for e in full.ledger.entries] == [e.to_dict() for e in fewer.ledger.entries]
    assert round((full.score - fewer.score) * m, 6) in (0.0, 1.0)  # the same noise, one count at most
    assert procedure.VALIDATION_SIZE_CAVEAT not in full.ledger.caveats()
    assert procedure.VALIDATION_SIZE_CAVEAT in tune(digits, mean=1.2).ledger.caveats()
    with pytest.raises(ValueError, match="public_validation_size=0 must be an integer >= 1"):
        tune(digits, public_validation_size=0)
