"""PReLU, ``y = relu(x) - alpha relu(-x)``: ``dL_i/dalpha = sum_{shared axes} -delta_i relu(-x_i)``."""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import LayerRule


class PReLURule(LayerRule):
    """PReLU: ``dL_i/dalpha = sum over the shared axes of -delta_i relu(-x_i)``."""

    norm_method = "elementwise"

    def variable_grad(self, layer, call, delta, selection):
        per_position = -delta * tf.nn.relu(-tf.cast(call.inputs, delta.dtype))
        shared = [a for a in (layer.shared_axes or [])]
        if shared:
            per_position = tf.reduce_sum(per_position, axis=shared, keepdims=True)
        return per_position


PRELU_RULE = PReLURule()
register_layer_rule(tf.keras.layers.PReLU, PRELU_RULE, verify=False)
