"""Command-line trainers (``sparta-train``)."""

import importlib.util as _util
import os as _os

# As sparta_tf.backend does (which cannot be imported here without importing TensorFlow, and
# config errors must stay fast): an installed tf-keras means Keras 2 unless TF_USE_LEGACY_KERAS=0.
if _util.find_spec("tf_keras") is not None:
    _os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# TensorFlow leaves oneDNN off on CPUs without AVX-512 (e.g. the AMD EPYC VMs we run on), and there
# the per-example gradients of grouped convolutions fail (TF's pfor fallback for Conv2DBackpropFilter
# with groups: "filter_size does not have enough elements"). On before TensorFlow is imported; a
# user's own TF_ENABLE_ONEDNN_OPTS wins.
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
