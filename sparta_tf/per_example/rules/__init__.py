"""The per-layer rules, one module per layer family, each holding its materialising rule
(per-example gradients) and its book-keeping rule (norms and clipped sums):

* :mod:`~sparta_tf.per_example.rules.base`: the two interfaces (``LayerRule``, ``GhostRule``)
  and the generic per-example VJP, exact for any layer;
* :mod:`~sparta_tf.per_example.rules.ghost_norms`: the norm algebra of linear maps;
* :mod:`~sparta_tf.per_example.rules.dense`, :mod:`~sparta_tf.per_example.rules.einsum`,
  :mod:`~sparta_tf.per_example.rules.conv2d`, :mod:`~sparta_tf.per_example.rules.convolution`,
  :mod:`~sparta_tf.per_example.rules.depthwise`, :mod:`~sparta_tf.per_example.rules.transposed`,
  :mod:`~sparta_tf.per_example.rules.normalization`, :mod:`~sparta_tf.per_example.rules.prelu`,
  :mod:`~sparta_tf.per_example.rules.embedding`, :mod:`~sparta_tf.per_example.rules.recurrent`:
  the built-in families, each registered with
  :func:`~sparta_tf.per_example.registry.register_layer_rule` when
  :mod:`sparta_tf.per_example` is imported;
* :mod:`~sparta_tf.per_example.rules.tokens`: learned-token rules that the layers using them
  register (the ViT's ``ClassToken`` and ``PositionEmbedding``).

This package imports none of them itself: the registry imports :mod:`.base`, and each family
imports the registry.
"""
