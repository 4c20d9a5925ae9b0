"""Model zoo: builds the model of a config's ``model:`` section.

The YAML section is a mapping with a ``name`` and that model's keys::

    model:
      name: wrn16_4_gn          # one of MODEL_REGISTRY
      groups: 16                # keyword arguments of the builder, passed through
      dropout_rate: 0.0

    model: {name: vit_tiny, dim: 64, depth: 4, heads: 2, mlp_dim: 128}

    model:
      name: keras_cv
      backbone: ResNetV2Backbone        # a keras_cv.models class, built from explicit args
      backbone_args: {stackwise_filters: [64, 128], stackwise_blocks: [2, 2],
                      stackwise_strides: [1, 2]}
      batchnorm: groupnorm              # or freeze

    model:
      name: keras_hub
      backbone: ResNetBackbone          # a keras_hub.models image backbone class, built from explicit args
      backbone_args: {input_conv_filters: [64], input_conv_kernel_sizes: [3],
                      stackwise_num_filters: [64, 128], stackwise_num_blocks: [2, 2],
                      stackwise_num_strides: [1, 2], block_type: basic_block}
      batchnorm: groupnorm              # or freeze
      weights: runs/backbone.weights.h5 # optional; random initialisation without it

    model: {name: saved, path: runs/pretrained.keras, fresh_head: true}

Builder keyword arguments may also be given under an ``args:`` mapping
(``{name: resnet20_gn, args: {groups: 8}}``); a key given both ways is an
error. ``num_classes`` and ``input_shape`` come from the data, never from
this section.

Names (:data:`MODEL_REGISTRY`):

* ``resnet20_gn``, ``resnet18_gn`` -- :mod:`sparta_tf.models.resnet`
  (args: ``groups``, ``width``, ``shortcut``, ``conv_bias``);
* ``wrn16_4_gn`` -- :func:`~sparta_tf.models.wrn.wrn_gn` with depth 16,
  width 4 (args: ``groups``, ``dropout_rate``, ``conv_bias``); ``wrn_gn`` --
  any depth/width;
* ``vit_tiny`` -- :func:`~sparta_tf.models.vit.vit_tiny` (args:
  ``patch_size``, ``dim``, ``depth``, ``heads``, ``mlp_dim``, ``dropout``);
* ``keras_cv`` -- a keras-cv backbone *class* (never a preset: presets
  download weights) constructed with ``backbone_args`` plus ``input_shape``
  (and ``include_rescaling=False`` unless given), BatchNorm handled by
  ``batchnorm`` (``groupnorm``, the default, or ``freeze``; see
  :func:`~sparta_tf.models.convert.replace_batchnorm`), then global average
  pooling (layer ``"pool"``) and ``Dense(num_classes, name="head")``;
* ``keras_hub`` (Keras 3 only, keras-hub 0.32) -- the same for a keras-hub image backbone class
  (:func:`~sparta_tf.models.backbones.keras_hub_backbone_names`: the ``backbone_cls`` of keras-hub's image classifiers), built
  with ``backbone_args`` plus ``image_shape`` from the data (never ``from_preset``: presets download
  weights); ``weights`` optionally loads the backbone's weights from a ``.weights.h5`` file written
  by ``backbone.save_weights`` (before BatchNorm is converted, so a trained BatchNorm backbone's
  other weights carry over); BatchNorm handled by ``batchnorm`` as for ``keras_cv``, then pooling
  (layer ``"pool"``) and ``Dense(num_classes, name="head")``. On Keras 2 it is a one-line error
  naming the fix, as ``keras_cv`` is on Keras 3;
* ``pretrained`` -- a public model shipped with sparta-tf, by name
  (``weights``; :mod:`sparta_tf.models.pretrained`), with a fresh head by
  default (``fresh_head: false`` keeps its public head);
* ``saved`` -- a saved Keras model at ``path`` (``.keras``, ``.h5`` or Keras
  SavedModel dir); ``fresh_head`` (default true) replaces its classifier by a
  new ``num_classes`` head (:func:`~sparta_tf.models.convert.with_fresh_head`),
  ``fresh_head: false`` keeps it (its output must have ``num_classes``
  units); ``batchnorm`` (``groupnorm``/``freeze``) converts BatchNorm first.

Unknown names or keys raise a one-line ``ValueError`` naming the key and the
valid choices; :func:`validate_model_spec` runs those checks without
building anything (for the CLI).
"""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from sparta_tf.models.architectures import ARCHITECTURES
from sparta_tf.models.backbones import KERAS_CV, KERAS_HUB
from sparta_tf.models.entries import ModelEntry, build, resolve
from sparta_tf.models.pretrained import PRETRAINED
from sparta_tf.models.saved import SAVED

__all__ = ["MODEL_REGISTRY", "build_model", "validate_model_spec"]

MODEL_REGISTRY: dict[str, ModelEntry] = {
    **ARCHITECTURES,
    "keras_cv": KERAS_CV,
    "keras_hub": KERAS_HUB,
    "pretrained": PRETRAINED,
    "saved": SAVED,
}
"""Every ``name`` of the ``model:`` section -> its entry (see the module docstring)."""


def validate_model_spec(spec: Mapping[str, Any]) -> tuple[str, dict]:
    """Checks a ``model:`` section without building; returns ``(name, keyword arguments)``.

    Raises a one-line ``ValueError`` naming the offending key and the valid
    choices.
    """
    return resolve(MODEL_REGISTRY, spec)


def build_model(spec: Mapping[str, Any], num_classes: int, input_shape) -> tf.keras.Model:
    """Builds the model of a config's ``model:`` section (see the module docstring).

    Args:
      spec: the ``model:`` mapping (``name`` plus that model's keys).
      num_classes: classes of the dataset (size of the head).
      input_shape: channels-last image shape ``(H, W, C)`` of the dataset.

    Returns:
      An uncompiled ``tf.keras.Model`` mapping images to logits whose
      classifier is the Dense layer named ``"head"``.
    """
    return build(MODEL_REGISTRY, spec, num_classes, input_shape)
