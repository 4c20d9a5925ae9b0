"""Which rule a layer gets: the one place that maps Keras layer classes to per-example rules.

:func:`rule_for` gives the materialising rule (:mod:`~sparta_tf.per_example.layer_rules`: per-example
gradients), :func:`ghost_rule_for` the book-keeping rule (norms and clipped sums, materialising only
where that is the cheaper or the only way), with the same probe point. Classes are matched exactly
(``type(layer) is ...``): a subclass may override ``call``, so it gets the generic per-example VJP
of its own call, which is exact for any layer. The table per layer: docs/layers.md.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.per_example.conv_rules import (
    CONVOLUTION_RULE,
    DEPTHWISE_RULE,
    PRE_ACTIVATION_CONVOLUTION_RULE,
    SEPARABLE_RULE,
    TRANSPOSED_CONVOLUTION_RULE,
    ConvolutionGhostRule,
    ConvolutionRule,
    calls_convolution_op,
)
from sparta_tf.per_example.ghost_rules import (
    Conv2DGhostRule,
    EmbeddingGhostRule,
    GhostRule,
    LinearGhostRule,
    einsum_layout,
)
from sparta_tf.per_example.layer_rules import (
    CONV2D_RULE,
    DENSE_RULE,
    PRE_ACTIVATION_VJP_RULE,
    VJP_RULE,
    LayerRule,
)
from sparta_tf.models.vit import ClassToken, PositionEmbedding
from sparta_tf.per_example.norm_rules import (
    CLASS_TOKEN_RULE,
    NORMALIZATION_RULE,
    POSITION_EMBEDDING_RULE,
    PRELU_RULE,
)
from sparta_tf.per_example.recurrent import RECURRENT_RULE, is_recurrent

L = tf.keras.layers
_CONVOLUTIONS = (L.Conv1D, L.Conv2D, L.Conv3D)
_TRANSPOSED = (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)
_NORMALIZATIONS = (L.LayerNormalization, L.GroupNormalization)


def _channels_last(layer) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def _convolution_rule(layer) -> LayerRule:
    """Conv1D / Conv2D / Conv3D, channels last: probed at ``convolution_op`` (one group) where the
    layer's call runs through it, else before the activation."""
    if layer.groups != 1 or not calls_convolution_op(layer):
        return PRE_ACTIVATION_CONVOLUTION_RULE
    if type(layer) is L.Conv2D and layer.padding in ("same", "valid"):
        return CONV2D_RULE
    return CONVOLUTION_RULE


def rule_for(layer: tf.keras.layers.Layer) -> LayerRule:
    """The fastest materialising rule that is exact for ``layer`` (the per-example VJP of its own
    call when no specific rule applies)."""
    kind = type(layer)
    if is_recurrent(layer):
        return RECURRENT_RULE
    if kind is L.Dense:
        return DENSE_RULE
    if kind is L.EinsumDense:
        return PRE_ACTIVATION_VJP_RULE
    if kind in _CONVOLUTIONS and _channels_last(layer):
        return _convolution_rule(layer)
    if kind is L.DepthwiseConv2D and _channels_last(layer):
        return DEPTHWISE_RULE
    if kind in _TRANSPOSED and _channels_last(layer) and layer.output_padding is None:
        return TRANSPOSED_CONVOLUTION_RULE
    if kind is L.SeparableConv2D and _channels_last(layer):
        return SEPARABLE_RULE
    if kind in _NORMALIZATIONS:
        return NORMALIZATION_RULE
    if kind is L.PReLU:
        return PRELU_RULE
    if kind is ClassToken:
        return CLASS_TOKEN_RULE
    if kind is PositionEmbedding:
        return POSITION_EMBEDDING_RULE
    return VJP_RULE


def ghost_rule_for(layer: tf.keras.layers.Layer) -> GhostRule:
    """The book-keeping rule of ``layer`` (the same probe point as :func:`rule_for`'s rule)."""
    reference = rule_for(layer)
    if reference is DENSE_RULE:
        return LinearGhostRule()
    if reference is CONV2D_RULE:
        return Conv2DGhostRule()
    if isinstance(reference, ConvolutionRule) and layer.groups == 1:
        return ConvolutionGhostRule(reference)
    if type(layer) is L.Embedding:
        return EmbeddingGhostRule()
    if type(layer) is L.EinsumDense:
        layout = einsum_layout(layer)
        if layout is not None:
            return LinearGhostRule(layout)
    return GhostRule(reference)  # per-example gradients from the reference rule, summed by the engine
