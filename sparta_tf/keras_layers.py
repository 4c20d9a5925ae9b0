"""Every layer of a Keras model, nested ones included: the one walk the library uses.

Keras 2 and Keras 3 both keep a layer's sublayers in tracked attributes and walk them with the
(private, same-named) ``Layer._flatten_layers``; Keras 3 models have no ``submodules`` and
``model.layers`` lists only the top level, so a nested model's or a custom layer's sublayers would
be missed. :func:`all_layers` is that walk, in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["all_layers"]


def all_layers(layer: tf.keras.layers.Layer) -> list[tf.keras.layers.Layer]:
    """Every layer nested inside ``layer`` (a model or a layer), at any depth, each once, in Keras'
    depth-first order; ``layer`` itself is not included."""
    return list(layer._flatten_layers(include_self=False, recursive=True))
