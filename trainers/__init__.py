"""Command-line trainers (``sparta-train``)."""

import os as _os

# TensorFlow leaves oneDNN off on CPUs without AVX-512 (e.g. the AMD EPYC VMs we run on), and there
# the per-example gradients of grouped convolutions fail (TF's pfor fallback for Conv2DBackpropFilter
# with groups: "filter_size does not have enough elements"). On before TensorFlow is imported; a
# user's own TF_ENABLE_ONEDNN_OPTS wins.
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
