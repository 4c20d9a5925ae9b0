"""Parameter roles and SPARTA's row groups.

Every trainable variable of a model gets one *role*:

* ``"kernel"`` -- the weight tensor of a maskable layer (Dense, Conv1D/2D/3D,
  DepthwiseConv2D, EinsumDense, hence also the projections inside
  MultiHeadAttention), except the classifier head. SPARTA selects rows of it.
* ``"bias"`` -- the bias of any layer.
* ``"norm"`` -- scale/offset of a normalisation layer (GroupNorm, LayerNorm,
  frozen BatchNorm).
* ``"head"`` -- the classifier head's kernel and bias.
* ``"other"`` -- anything else (embeddings, positional embeddings, class
  tokens, custom weights): frozen by every sparse method, as in the authors'
  code, and trained only by ``all``.

**Rows.** A row of the paper is one *output unit* of a layer. PyTorch stores
weights ``[out, in, ...]``; Keras puts the output axes *last* (Dense
``[in, out]``, Conv2D ``[kh, kw, in, out]``, DepthwiseConv2D
``[kh, kw, in, multiplier]`` whose output channel is ``(in, multiplier)``,
EinsumDense: the kernel axes that appear in the output of the equation). The
*row view* of a kernel moves the output axes last and flattens::

    R(W) = reshape(transpose(W, input_axes + output_axes), [fan_in, n_rows])

so row ``j`` of the paper is column ``R(W)[:, j]``, a group of ``fan_in``
coordinates.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np
import tensorflow as tf

from sparta_tf.backend import depthwise_kernel, owned_variables, variable_key
from sparta_tf.keras_layers import all_layers
from sparta_tf.model_checks import is_batch_normalization

ROLES = ("kernel", "bias", "norm", "head", "other")
HEAD_LAYER_NAME = "head"

_NORM_LAYERS = (
    tf.keras.layers.GroupNormalization,
    tf.keras.layers.LayerNormalization,
)
_LAST_AXIS_KERNEL_LAYERS = (
    tf.keras.layers.Dense,
    tf.keras.layers.Conv1D,
    tf.keras.layers.Conv2D,
    tf.keras.layers.Conv3D,
)

# Transposed convolutions store [k..., out, in] and separable ones two kernels:
# not maskable (they subclass the Conv layers above, so they are excluded first).
_NOT_MASKABLE_CONVS = (
    tf.keras.layers.Conv1DTranspose,
    tf.keras.layers.Conv2DTranspose,
    tf.keras.layers.Conv3DTranspose,
    tf.keras.layers.SeparableConv1D,
    tf.keras.layers.SeparableConv2D,
)


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """The row structure of one maskable kernel."""

    layer: str
    variable: tf.Variable = dataclasses.field(repr=False, compare=False)
    output_axes: tuple[int, ...]
    n_rows: int
    row_size: int

    @property
    def name(self) -> str:
        return variable_key(self.variable)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape.as_list())

    @property
    def input_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.shape)) if a not in self.output_axes)

    def row_flat_indices(self, rows: Sequence[int]) -> np.ndarray:
        """Flat (row-major) indices of the coordinates of ``rows``, ordered ``[fan_in, len(rows)]``.

        Position ``f * len(rows) + k`` holds the flat index of ``R(W)[f, rows[k]]``,
        so a compact row-block ``[fan_in, len(rows)]`` flattened row-major lines
        up with these indices.
        """
        ids = np.arange(int(np.prod(self.shape)), dtype=np.int64).reshape(self.shape)
        view = ids.transpose(self.input_axes + self.output_axes).reshape(self.row_size, self.n_rows)
        return np.ascontiguousarray(view[:, np.asarray(rows, dtype=np.int64)]).reshape(-1)

    def to_row_view(self, t: tf.Tensor, batch_dims: int = 0) -> tf.Tensor:
        """``[*batch, *shape] -> [*batch, fan_in, n_rows]`` (the row view ``R``)."""
        perm = list(range(batch_dims)) + [a + batch_dims for a in self.input_axes + self.output_axes]
        if perm != sorted(perm):
            t = tf.transpose(t, perm)
        batch_shape = tf.shape(t)[:batch_dims]
        return tf.reshape(t, tf.concat([batch_shape, [self.row_size, self.n_rows]], 0))


def find_head(model: tf.keras.Model) -> tf.keras.layers.Layer | None:
    """The classifier head: the layer named ``"head"``, else the last Dense/EinsumDense with a kernel."""
    candidates = []
    for layer in _leaf_layers(model):
        if layer.name == HEAD_LAYER_NAME:
            return layer
        if isinstance(layer, (tf.keras.layers.Dense, tf.keras.layers.EinsumDense)) and layer.trainable_weights:
            candidates.append(layer)
    return candidates[-1] if candidates else None


def _leaf_layers(model: tf.keras.Model) -> list[tf.keras.layers.Layer]:
    layers = []
    for module in all_layers(model):
        if owned_variables(module):
            layers.append(module)
    return layers


def _einsum_output_axes(layer: tf.keras.layers.EinsumDense) -> tuple[int, ...]:
    match = re.fullmatch(r"\s*([\w.]+)\s*,\s*(\w+)\s*->\s*([\w.]+)\s*", layer.equation)
    if match is None:
        raise ValueError(f"cannot parse the EinsumDense equation {layer.equation!r} of {layer.name!r}")
    kernel_spec, output_spec = match.group(2), match.group(3)
    return tuple(a for a, letter in enumerate(kernel_spec) if letter in output_spec)


def output_axes(layer: tf.keras.layers.Layer, variable: tf.Variable) -> tuple[int, ...] | None:
    """The output axes of ``variable`` when it is a maskable kernel of ``layer``, else None."""
    rank = variable.shape.rank
    if isinstance(layer, tf.keras.layers.DepthwiseConv2D):
        return (2, 3) if variable is depthwise_kernel(layer) else None
    if isinstance(layer, _NOT_MASKABLE_CONVS):
        return None
    if isinstance(layer, _LAST_AXIS_KERNEL_LAYERS):
        return (rank - 1,) if variable is layer.kernel else None
    if isinstance(layer, tf.keras.layers.EinsumDense):
        return _einsum_output_axes(layer) if variable is layer.kernel else None
    return None


def _role(layer, variable, head) -> str:
    if head is not None and layer is head:
        return "head"
    if isinstance(layer, _NORM_LAYERS) or is_batch_normalization(layer):
        return "norm"
    if variable is getattr(layer, "bias", None):
        return "bias"
    if output_axes(layer, variable) is not None:
        return "kernel"
    return "other"


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
    """One trainable variable: its layer, role and (for kernels) row group."""

    layer: str
    variable: tf.Variable = dataclasses.field(repr=False, compare=False)
    role: str
    group: RowGroup | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.variable.shape.as_list()))


def parameter_table(model: tf.keras.Model, head: str | tf.keras.layers.Layer | None = None) -> list[ParameterInfo]:
    """Every trainable variable of ``model`` with its role, in layer order.

    ``head``: the classifier head (layer or name); default :func:`find_head`.
    """
    if isinstance(head, str):
        head = model.get_layer(head) if head in [l.name for l in model.layers] else _layer_named(model, head)
    elif head is None:
        head = find_head(model)
    trainable = {id(v) for v in model.trainable_variables}
    table = []
    for layer in _leaf_layers(model):
        for variable in owned_variables(layer):  # the non-trainable ones are skipped below
            if id(variable) not in trainable:
                continue
            role = _role(layer, variable, head)
            group = None
            if role == "kernel":
                axes = output_axes(layer, variable)
                shape = variable.shape.as_list()
                n_rows = int(np.prod([shape[a] for a in axes]))
                group = RowGroup(layer.name, variable, axes, n_rows, int(np.prod(shape)) // n_rows)
            table.append(ParameterInfo(layer.name, variable, role, group))
    return table


def _layer_named(model, name):
    for layer in _leaf_layers(model):
        if layer.name == name:
            return layer
    raise ValueError(f"the model has no layer named {name!r} to use as the classifier head")


def row_groups(model: tf.keras.Model, head=None) -> list[RowGroup]:
    """The row groups of every maskable kernel (the head excluded)."""
    return [p.group for p in parameter_table(model, head) if p.group is not None]


def group_table(model: tf.keras.Model, head=None) -> str:
    """A Markdown table (layer, variable, shape, rows, row size) for inspection."""
    lines = ["| layer | variable | shape | rows | row size |", "|---|---|---|---:|---:|"]
    for g in row_groups(model, head):
        lines.append(f"| {g.layer} | {g.name} | {list(g.shape)} | {g.n_rows} | {g.row_size} |")
    return "\n".join(lines)
