"""DP-SSGD: pre-pruning (random, Synflow, DP-SNIP) and gradient dropping."""

import functools
import inspect
import math

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.ssgd import (
    SSGDModel,
    keep_fraction,
    prune_dp_snip,
    prune_random,
    prune_synflow,
)
from small_models import gaussian_data

N, D, H, K = 32, 6, 10, 3


def _model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((D,))
    hidden = tf.keras.layers.Dense(H, activation="relu", bias_initializer="random_normal")(inputs)
    outputs = tf.keras.layers.Dense(K, activation="softmax", bias_initializer="random_normal")(hidden)
    return tf.keras.Model(inputs, outputs)


_data = functools.partial(gaussian_data, N, (D,), K)


def _ssgd(model, masks, drop_rate, drop_mode="random", momentum=0.9, lr=0.1, sigma=1.0, clip=1.0):
    dp = SSGDModel(model, keep_masks=masks, drop_rate=drop_rate, drop_mode=drop_mode,
                   noise_multiplier=sigma, clip_norm=clip, sample_rate=0.25, dataset_size=N, seed=3)
    dp.compile(optimizer=tf.keras.optimizers.SGD(lr, momentum=momentum),
               loss="sparse_categorical_crossentropy")
    return dp


def _full(selection, compact):
    """Boolean mask of the variable's shape from a compact-shape mask."""
    full = np.zeros(int(np.prod(selection.shape)), dtype=bool)
    idx = selection.flat_indices
    full[slice(None) if idx is None else idx] = np.asarray(compact).reshape(-1)
    return full.reshape(selection.shape)


# ------------------------------------------------------------ pre-pruning


def test_synflow_signature_has_no_data_and_matches_closed_form():
    params = set(inspect.signature(prune_synflow).parameters)
    assert not params & {"x", "y", "data", "dataset", "inputs", "loss", "ledger"}
    model = _model()
    before = [v.numpy() for v in model.trainable_variables]
    masks = prune_synflow(model, rate=0.5, iterations=1)  # no data anywhere
    (k1, m1), (k2, m2) = masks
    w1, b1, w2, _ = before
    # R = 1^T|W2|^T(|W1|^T 1 + |b1|) + ...  =>  S(W1_ij) = |W1_ij| rowsum|W2|_j, S(W2_jk) = |W2_jk| (colsum|W1|_j + |b1_j|)
    s1 = np.abs(w1) * np.abs(w2).sum(1)[None, :]
    s2 = np.abs(w2) * (np.abs(w1).sum(0) + np.abs(b1))[:, None]
    scores = np.concatenate([s1.ravel(), s2.ravel()])
    keep = round(0.5 * scores.size)
    threshold = np.sort(scores)[::-1][keep - 1]
    np.testing.assert_array_equal(np.concatenate([m1.ravel(), m2.ravel()]), scores >= threshold)
    assert keep_fraction(masks) == pytest.approx(0.5, abs=1e-9)
    # pruned weights are zero, the rest (and biases, activations) restored exactly
    np.testing.assert_array_equal(k1.numpy(), np.where(m1, w1, 0))
    np.testing.assert_array_equal(model.trainable_variables[1].numpy(), b1)
    assert model.layers[-1].activation is tf.keras.activations.softmax


def test_synflow_iterative_reaches_rate_and_keeps_pruned_pruned():
    model = _model(1)
    masks = prune_synflow(model, rate=0.8, iterations=5)
    m = sum(mask.size for _, mask in masks)
    assert sum(int(mask.sum()) for _, mask in masks) == round(0.2 * m)
    for variable, mask in masks:
        assert np.all(variable.numpy()[~mask] == 0)


def test_prune_random_per_layer_rate():
    model = _model()
    masks = prune_random(model, 0.75, seed=0)
    for variable, mask in masks:
        assert (~mask).sum() == math.floor(0.75 * mask.size)
        assert np.all(variable.numpy()[~mask] == 0)


def test_dp_snip_charges_ledger_and_prunes():
    model = _model()
    x, y = _data()
    ledger = PrivacyLedger(1e-5)
    masks = prune_dp_snip(model, x, y, "sparse_categorical_crossentropy", 0.5, noise_multiplier=2.0,
                          clip_norm=1.0, sample_rate=1.0, ledger=ledger, seed=0)
    assert ledger.steps == 1
    (entry,) = ledger.entries
    assert (entry.noise_multiplier, entry.sample_rate, entry.kind) == (2.0, 1.0, "dp_snip")
    assert 0 < ledger.epsilon() < math.inf
    assert keep_fraction(masks) == pytest.approx(0.5, abs=0.02)
    for variable, mask in masks:
        assert np.all(variable.numpy()[~mask] == 0)
    with pytest.raises(ValueError):
        prune_dp_snip(model, x, y, "sparse_categorical_crossentropy", 0.5, 2.0, 1.0, 1.0, ledger=None)


# ------------------------------------------------------- gradient dropping


def test_random_dropping_rate_and_fresh_set_each_step():
    model = _model()
    dp = _ssgd(model, prune_random(model, 0.5, seed=0), drop_rate=0.6)
    previous = None
    for step in range(3):
        keep = [m.numpy() for m in dp.keep_masks_for_step(step)]
        for selection, mask in zip(dp.trainable_set, keep):
            assert mask.shape == selection.compact_shape
            assert mask.sum() == selection.size - math.floor(0.6 * selection.size)
        if previous is not None:
            assert any(not np.array_equal(a, b) for a, b in zip(previous, keep))
        previous = keep


def test_magnitude_dropping_keeps_largest_weights():
    model = _model()
    dp = _ssgd(model, prune_random(model, 0.5, seed=0), drop_rate=0.5, drop_mode="magnitude")
    for selection, mask in zip(dp.trainable_set, dp.keep_masks_for_step(0)):
        values = np.abs(selection.compact(tf.convert_to_tensor(selection.variable)).numpy()).ravel()
        mask = mask.numpy().ravel()
        assert values[mask].min() >= values[~mask].max()


@pytest.mark.parametrize("mode", ["random", "magnitude"])
def test_pruned_and_dropped_weights_stay_exactly(mode):
    model = _model()
    x, y = _data()
    masks = prune_random(model, 0.5, seed=1)
    dp = _ssgd(model, masks, drop_rate=0.5, drop_mode=mode, momentum=0.9)
    pruned = {id(v): m for v, m in masks}
    for _ in range(3):  # momentum: a dropped coordinate must not move even after earlier updates
        step = int(dp.dp_step.numpy())
        keep = [m.numpy() for m in dp.keep_masks_for_step(step)]
        before = [v.numpy() for v in model.trainable_variables]
        dp.train_on_batch(x[:8], y[:8])
        assert int(dp.dp_step.numpy()) == step + 1
        for selection, compact in zip(dp.trainable_set, keep):
            i = next(j for j, v in enumerate(model.trainable_variables) if v is selection.variable)
            moved = selection.variable.numpy() != before[i]
            kept = _full(selection, compact)
            assert not moved[~kept].any(), f"{selection.variable.name}: a dropped/frozen weight moved"
            assert moved[kept].all()  # noise on every kept coordinate
            if id(selection.variable) in pruned:
                assert np.all(selection.variable.numpy()[~pruned[id(selection.variable)]] == 0)


def test_noise_only_on_kept_indices():
    model = _model()
    x, y = _data()
    dp = _ssgd(model, prune_random(model, 0.5, seed=2), drop_rate=0.7, momentum=0.0, lr=1.0)
    keep = [m.numpy() for m in dp.keep_masks_for_step(0)]
    before = [v.numpy() for v in model.trainable_variables]
    dp.train_on_batch(x[:8], y[:8], sample_weight=np.zeros(8, np.float32))  # all padding: pure noise
    deltas = []
    for selection, compact in zip(dp.trainable_set, keep):
        i = next(j for j, v in enumerate(model.trainable_variables) if v is selection.variable)
        delta = selection.variable.numpy() - before[i]
        kept = _full(selection, compact)
        assert np.all(delta[~kept] == 0)
        assert np.all(delta[kept] != 0)
        deltas.append(delta[kept])
    # update = -lr * sigma C zeta / (q n) on I_s
    std = np.concatenate(deltas).std()
    assert std == pytest.approx(1.0 * 1.0 / (0.25 * N), rel=0.3)


def test_zero_drop_rate_is_plain_dp_sgd_on_pruned_set():
    model = _model()
    x, y = _data()
    masks = prune_random(model, 0.5, seed=0)
    dp = _ssgd(model, masks, drop_rate=0.0)
    assert all(m.numpy().all() for m in dp.keep_masks_for_step(0))
    dp.train_on_batch(x[:8], y[:8])
    for variable, mask in masks:
        assert np.all(variable.numpy()[~mask] == 0)
        assert np.all(variable.numpy()[mask] != 0)


def test_noisy_gradient_is_zero_outside_kept_indices():
    model = _model()
    dp = _ssgd(model, prune_random(model, 0.5, seed=2), drop_rate=0.7)
    keep = dp.keep_masks_for_step(0)
    release = dp.step_parts().release
    noisy = release.noisy_gradient([tf.zeros(s.compact_shape) for s in dp.trainable_set], dp.dp_step, keep)
    for g, k in zip(noisy, keep):
        g, k = g.numpy(), k.numpy()
        assert np.all(g[~k] == 0) and np.all(g[k] != 0)


def test_optimizer_state_of_dropped_coordinates_is_frozen():
    model = _model()
    x, y = _data()
    dp = _ssgd(model, prune_random(model, 0.5, seed=1), drop_rate=0.5, momentum=0.9)
    opt = dp._masked_optimizer
    for _ in range(3):
        keep = [m.numpy() for m in dp.keep_masks_for_step(int(dp.dp_step.numpy()))]
        before = [opt.slots[key][0].numpy() for key in opt._keys]
        dp.train_on_batch(x[:8], y[:8])
        for key, k, old in zip(opt._keys, keep, before):
            new = opt.slots[key][0].numpy()
            np.testing.assert_array_equal(new[~k], old[~k])
            assert np.all(new[k] != old[k])


def test_clipping_norm_is_over_kept_indices_only():
    """Eq. (3): one example, always clipped, no noise: ||update on I_s|| = lr C / (q n)."""
    model = _model()
    x, y = _data()
    clip, lr = 1e-4, 1.0
    dp = _ssgd(model, prune_random(model, 0.5, seed=0), drop_rate=0.6, momentum=0.0, lr=lr, sigma=0.0, clip=clip)
    before = [v.numpy() for v in model.trainable_variables]
    weights = np.zeros(8, np.float32)
    weights[0] = 1.0
    dp.train_on_batch(x[:8], y[:8], sample_weight=weights)
    delta = np.concatenate([(v.numpy() - b).ravel() for v, b in zip(model.trainable_variables, before)])
    assert np.linalg.norm(delta) == pytest.approx(lr * clip / (0.25 * N), rel=1e-3)
