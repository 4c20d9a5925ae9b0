"""Command-line trainers (``sparta-train``)."""

import os as _os

# TensorFlow leaves oneDNN off on CPUs without AVX-512, and there its own kernels cannot differentiate a
# grouped convolution per example: the vectorized engine then runs it by a block-diagonal kernel, exact
# but `groups` times the multiply-adds (sparta_tf.per_example.grouped_conv). On before TensorFlow is
# imported, for speed; a user's own TF_ENABLE_ONEDNN_OPTS wins.
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
