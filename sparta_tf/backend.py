"""Which Keras ``tf.keras`` is, and the few Keras 2 / Keras 3 differences the library needs.

Imported before any top-level name of ``sparta_tf`` is resolved (``sparta_tf.make_private``,
...; ``import sparta_tf`` alone imports nothing), and by the modules that differ
between the Keras lines. It does not choose the Keras: ``tf.keras`` is whatever
TensorFlow resolves it to, and the library runs on both lines it supports
(docs/versions.md):

* **Keras 3** with the TensorFlow backend: ``tf.keras`` of TF >= 2.16 (the default
  of ``pip install tensorflow``; Python 3.12/3.13's install). :data:`KERAS3` is True.
* **Keras 2**: ``tf.keras`` of TF 2.15 (built in; Python 3.11's install), or the
  ``tf-keras`` package on TF >= 2.16 when the user sets ``TF_USE_LEGACY_KERAS=1``
  before TensorFlow is imported (TensorFlow's own switch).

Any other Keras (Keras 3 with a non-TensorFlow backend, Keras older than 2.15 or
3.10) gets one line, :class:`UnsupportedKerasError`, naming the supported versions.

The helpers paper over the API differences the library uses:

========================  =================================  ========================================
helper                    Keras 2                            Keras 3
========================  =================================  ========================================
:func:`variable_key`      ``v.name`` (``"dense/kernel:0"``)  ``v.path`` (``"dense/kernel"``)
:func:`tf_variable`       ``v`` (a ``tf.Variable``)          ``v.value`` (the ``tf.Variable`` inside)
:func:`learning_rate`     ``opt._learning_rate``             ``opt._learning_rate`` (same name)
:func:`depthwise_kernel`  ``depthwise_kernel``               ``kernel`` (DepthwiseConv2D)
:func:`rnn_loop`          ``tf.keras.backend.rnn``           ``keras.src.backend.tensorflow.rnn.rnn``
========================  =================================  ========================================
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.autograph_rule import exempt_the_library

exempt_the_library()  # before any traced code of the library runs (sparta_tf.autograph_rule)

MIN_KERAS3 = (3, 10)  # what TensorFlow 2.21 requires; 3.15.1 is the version tested (requirements/keras3.txt)

SUPPORTED = (f"Keras >= {MIN_KERAS3[0]}.{MIN_KERAS3[1]} with the TensorFlow backend (TensorFlow >= 2.16) or "
             "Keras 2 (TensorFlow 2.15, or tf-keras 2.x with TF_USE_LEGACY_KERAS=1)")


class UnsupportedKerasError(ImportError):
    """``tf.keras`` is a Keras sparta-tf does not run on (see :data:`SUPPORTED`)."""


def keras_version() -> str:
    """The version of the Keras behind ``tf.keras``."""
    version = getattr(tf.keras, "__version__", None)
    if version is None and getattr(tf.keras, "__name__", "").startswith("tf_keras"):
        import tf_keras

        version = tf_keras.__version__
    if version is None:
        import keras

        version = keras.__version__
    return str(version)


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split(".") + ["0", "0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def keras_backend() -> str:
    """``"tensorflow"`` on Keras 2; Keras 3's configured backend otherwise."""
    backend = getattr(tf.keras, "backend", None)
    name = getattr(backend, "backend", None)
    return name() if callable(name) else "tensorflow"


def check_supported(version: str | None = None, backend: str | None = None) -> bool:
    """True for Keras 3, False for Keras 2; raises :class:`UnsupportedKerasError` (one line) otherwise."""
    version = keras_version() if version is None else version
    backend = keras_backend() if backend is None else backend
    major_minor = _major_minor(version)
    if major_minor[0] == 2 and major_minor >= (2, 15):
        return False
    if major_minor[0] == 3 and major_minor >= MIN_KERAS3 and backend == "tensorflow":
        return True
    fix = ("set KERAS_BACKEND=tensorflow" if major_minor[0] == 3 and major_minor >= MIN_KERAS3
           else "pip install -r requirements/keras3.txt (or tf-keras matching your TensorFlow)")
    raise UnsupportedKerasError(f"sparta-tf runs on {SUPPORTED}; this is Keras {version} with the {backend} backend "
                                f"(TensorFlow {tf.__version__}): {fix}")


KERAS3: bool = check_supported()
"""True when ``tf.keras`` is Keras 3, False on Keras 2."""


def variable_key(variable) -> str:
    """A variable's unique name: ``name`` on Keras 2 (``"dense/kernel:0"``), ``path`` on Keras 3
    (``"dense/kernel"``; Keras 3's ``name`` is the short ``"kernel"``)."""
    path = getattr(variable, "path", None) if KERAS3 else None
    return str(path) if path is not None else variable.name


def tf_variable(variable) -> tf.Variable:
    """The ``tf.Variable`` holding ``variable``'s value: itself on Keras 2, ``variable.value`` for a
    Keras 3 ``keras.Variable`` (which has no ``scatter_nd_sub``). Writes through it write the variable."""
    if isinstance(variable, tf.Variable):
        return variable
    value = getattr(variable, "value", None)
    if isinstance(value, tf.Variable):
        return value
    raise TypeError(f"{type(variable).__name__} is not a TensorFlow or Keras variable")


def learning_rate(optimizer) -> object:
    """The optimizer's learning rate as given: a float, variable or ``LearningRateSchedule``."""
    return optimizer._learning_rate  # the same (private) attribute on Keras 2 and Keras 3


def owned_variables(layer) -> list:
    """The variables ``layer`` created itself (trainable first), not those of its sublayers:
    ``_trainable_weights`` / ``_non_trainable_weights`` on Keras 2, ``_trainable_variables`` /
    ``_non_trainable_variables`` on Keras 3."""
    if KERAS3:
        return list(getattr(layer, "_trainable_variables", ())) + list(getattr(layer, "_non_trainable_variables", ()))
    return list(layer._trainable_weights) + list(layer._non_trainable_weights)


def depthwise_kernel(layer):
    """The depthwise kernel ``[kh, kw, c, multiplier]`` of a DepthwiseConv2D or SeparableConv layer:
    ``depthwise_kernel`` on Keras 2 (both layers) and on Keras 3's SeparableConv; Keras 3's
    DepthwiseConv2D calls it ``kernel``."""
    kernel = getattr(layer, "depthwise_kernel", None)
    return layer.kernel if kernel is None else kernel


def rnn_loop(step_function, inputs, initial_states, **kwargs):
    """The loop of ``keras.layers.RNN``: ``(last_output, outputs, new_states)`` of ``step_function``
    over the time axis. ``tf.keras.backend.rnn`` on Keras 2; on Keras 3 the TensorFlow backend's
    ``rnn`` (the same arguments; not exported by Keras 3), which reads an unknown length from
    ``inputs.shape``: nested ``inputs`` then go in as one tensor (:func:`_side_by_side`)."""
    if not KERAS3:
        return tf.keras.backend.rnn(step_function, inputs, initial_states, **kwargs)
    from keras.src.backend.tensorflow.rnn import rnn

    if not tf.nest.is_nested(inputs) or kwargs.get("input_length") is not None:
        return rnn(step_function, inputs, initial_states, **kwargs)
    packed, unpack = _side_by_side(inputs)
    return rnn(lambda x_t, states: step_function(unpack(x_t), states), packed, initial_states, **kwargs)


def _side_by_side(inputs):
    """``(packed, unpack)``: the sequences ``inputs`` (a structure of ``[B, T, *S_k]``, one dtype,
    static ``S_k``) as one ``[B, T, sum_k prod(S_k)]`` tensor, and ``unpack``, which turns one step
    ``[B, sum_k prod(S_k)]`` of it back into the structure of ``[B, *S_k]``."""
    leaves = tf.nest.flatten(inputs)
    if len({t.dtype for t in leaves}) != 1 or not all(t.shape[2:].is_fully_defined() for t in leaves):
        raise TypeError("a nested recurrence of unknown length needs one dtype and static step shapes")
    tails = [t.shape[2:].as_list() for t in leaves]
    sizes = [int(t.shape[2:].num_elements()) for t in leaves]
    batch, steps = tf.shape(leaves[0])[0], tf.shape(leaves[0])[1]
    packed = tf.concat([tf.reshape(t, [batch, steps, n]) for t, n in zip(leaves, sizes)], axis=-1)

    def unpack(step):
        parts = tf.split(step, sizes, axis=-1)
        return tf.nest.pack_sequence_as(inputs, [tf.reshape(p, [-1, *tail]) for p, tail in zip(parts, tails)])

    return packed, unpack


def rnn_initial_state(layer, inputs):
    """The initial state a recurrent ``layer`` starts from on ``inputs`` when its call is given none
    (zeros, or the cell's ``get_initial_state``): ``layer.get_initial_state(inputs)`` on Keras 2,
    ``layer.get_initial_state(batch_size)`` on Keras 3."""
    if KERAS3:
        return layer.get_initial_state(batch_size=tf.shape(inputs)[0])
    return layer.get_initial_state(inputs)


def name_state() -> object:
    """A snapshot of Keras's automatic-name counters (``dense``, ``dense_1``, ...), for
    :func:`restore_name_state`: Keras 3 keeps them in ``global_state``'s ``object_name_uids``, Keras 2 per
    graph in its backend module (with the set of names already observed)."""
    if KERAS3:
        from keras.src.backend.common import global_state

        return dict(global_state.get_global_attribute("object_name_uids", default={}) or {})
    module = _keras2_backend_module()
    return ({graph: dict(uids) for graph, uids in module.PER_GRAPH_OBJECT_NAME_UIDS.items()},
            set(module.OBSERVED_NAMES))


def restore_name_state(state: object) -> None:
    """Puts Keras's automatic-name counters back as :func:`name_state` saw them, so that the next models
    built get the names they would have got then (whatever was built since)."""
    import collections

    if KERAS3:
        from keras.src.backend.common import global_state

        global_state.set_global_attribute("object_name_uids", collections.defaultdict(int, state))
        return
    module = _keras2_backend_module()
    per_graph, observed = state
    module.PER_GRAPH_OBJECT_NAME_UIDS.clear()
    module.PER_GRAPH_OBJECT_NAME_UIDS.update({graph: collections.defaultdict(int, uids)
                                              for graph, uids in per_graph.items()})
    module.OBSERVED_NAMES.clear()
    module.OBSERVED_NAMES.update(observed)


def _keras2_backend_module():
    """The Keras 2 backend module behind ``tf.keras.backend`` (``keras.src.backend`` or ``tf_keras``'s)."""
    import sys

    return sys.modules[tf.keras.backend.get_uid.__module__]
