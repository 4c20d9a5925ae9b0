"""Per-example losses from whatever the user passes to ``compile(loss=...)``."""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

PerExampleLoss = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def per_example_loss_fn(loss) -> PerExampleLoss:
    """``loss`` (name, function or ``tf.keras.losses.Loss``) as ``(y, y_pred) -> [B]``.

    Keras ``Loss`` objects are used through their unreduced ``call``; any axes
    beyond the batch axis that remain (e.g. per-token losses) are averaged, so
    every example contributes one scalar ``L_i``.
    """
    if loss is None:
        raise ValueError("compile(loss=...) is required: DP-SGD clips gradients of a per-example loss")
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError("multi-output losses are not supported yet: pass one loss for one output")
    if isinstance(loss, tf.keras.losses.Loss):
        if not hasattr(loss, "fn"):
            raise ValueError(
                f"loss {type(loss).__name__} has no unreduced form; pass a built-in Keras loss "
                "or a function (y_true, y_pred) -> per-example loss"
            )
        base, kwargs = loss.fn, getattr(loss, "_fn_kwargs", {})
    else:
        base, kwargs = tf.keras.losses.get(loss), {}

    def per_example(y_true, y_pred):
        values = base(y_true, y_pred, **kwargs)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    return per_example
