"""``sparta_tf.check_augmentation``: a model's accuracy on public examples and on their views."""

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf


def _argmax_model() -> tf.keras.Model:
    """Scores = the input itself: the predicted class is the input's largest coordinate."""
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(4, use_bias=False)])
    model.layers[0].kernel.assign(tf.eye(4))
    return model


def _data():
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    return x, x.argmax(axis=1)


def same(example, seed):
    return example


def negated(example, seed):  # the largest coordinate becomes the smallest: never the label
    return -example


def jitter(example, seed):
    return example + 0.01 * tf.random.stateless_normal(tf.shape(example), seed)


def test_label_preserving_views_keep_the_accuracy_and_others_lose_it():
    x, y = _data()
    kept = sparta_tf.check_augmentation(_argmax_model(), x, y, augmentation=same)
    assert kept.clean == 1.0 == kept.views_accuracy and kept.drop == 0.0 and kept.views == 4
    lost = sparta_tf.check_augmentation(_argmax_model(), x, y, augmentation=negated, views=2)
    assert lost.clean == 1.0 and lost.views_accuracy == 0.0 and lost.drop == 1.0
    assert "accuracy 1.0000 on the examples, 0.0000 on 2 views of each (-1.0000)" == str(lost)


def test_views_are_drawn_afresh_and_one_hot_labels_are_accepted():
    x, y = _data()
    x[:, 1] = x[:, 0] + 1e-3  # near ties: jitter flips some
    y = x.argmax(axis=1)
    one_hot = np.eye(4)[y]
    first = sparta_tf.check_augmentation(_argmax_model(), x, one_hot, augmentation=jitter, views=3, seed=0)
    again = sparta_tf.check_augmentation(_argmax_model(), x, y, augmentation=jitter, views=3, seed=0)
    assert first == again and first.clean == 1.0 and first.views_accuracy < 1.0


@pytest.mark.parametrize("views", [0, 1.5, True])
def test_a_bad_number_of_views_is_refused_in_one_line(views):
    x, y = _data()
    with pytest.raises(ValueError, match=r"^views=.* must be an integer >= 1[^\n]*$"):
        sparta_tf.check_augmentation(_argmax_model(), x, y, augmentation=same, views=views)
