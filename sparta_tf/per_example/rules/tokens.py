"""Learned tokens added to or prepended to a sequence: per-example gradients are ``delta`` itself.

* A learned additive embedding ``y = x + E`` (the ViT's ``PositionEmbedding``): ``dL_i/dE = delta_i``.
* A learned token prepended to the sequence, ``y = [c, x]`` (the ViT's ``ClassToken``):
  ``dL_i/dc = delta_i[0]``.

The layers that use these rules register them where they are defined
(:mod:`sparta_tf.models.vit`), through :func:`~sparta_tf.per_example.registry.register_layer_rule`.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.per_example.rules.base import LayerRule


class LearnedTokenRule(LayerRule):
    """PositionEmbedding (``dL_i/dE = delta_i``) and ClassToken (``dL_i/dc = delta_i[0]``)."""

    norm_method = "elementwise"

    def __init__(self, first_token_only: bool):
        self.first_token_only = first_token_only

    def variable_grad(self, layer, call, delta, selection):
        grads = delta[:, :1] if self.first_token_only else delta
        return tf.reshape(grads, tf.concat([tf.shape(grads)[:1], selection.shape], 0))
