"""Data sources for the config-driven trainer: the ``data:`` section -> in-memory arrays.

``load_dataset(spec, seed=...)`` turns a config's ``data:`` mapping into a
:class:`Dataset` of float32 NHWC images in [0, 1] (optionally standardised)
and int64 labels, split into train/validation/test. Sources: ``synthetic``,
``digits`` (scikit-learn), ``npz``, ``idx`` (MNIST format), ``folder``
(image folders), ``tar`` (archived image folders, cached) and ``tfds``
(offline unless ``download: true``). Problems raise :class:`DataError`
with a one-line message naming the ``data.<key>`` and the fix.

``make_augmenter`` / ``augment`` provide flip+shift augmentation for
non-private pre-training only (not supported during DP training).

The package imports its modules on first use (PEP 562 module ``__getattr__``), so the
TensorFlow-free validation (:mod:`sparta_tf.data.spec`, :mod:`sparta_tf.data.errors`) imports
without TensorFlow: ``sparta-train`` checks a config's ``data:`` section before importing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparta_tf.lazy_exports import lazy_exports

if TYPE_CHECKING:  # for type checkers and the API reference (static); at run time __getattr__ imports them
    from sparta_tf.data.augment import augment, make_augmenter
    from sparta_tf.data.dataset import Dataset
    from sparta_tf.data.errors import DataError
    from sparta_tf.data.loader import load_dataset
    from sparta_tf.data.sources import SOURCES
    from sparta_tf.data.spec import DataSpec, parse_spec

_PUBLIC: dict[str, str] = {
    "DataError": "sparta_tf.data.errors",
    "DataSpec": "sparta_tf.data.spec",
    "Dataset": "sparta_tf.data.dataset",
    "SOURCES": "sparta_tf.data.sources",
    "augment": "sparta_tf.data.augment",
    "load_dataset": "sparta_tf.data.loader",
    "make_augmenter": "sparta_tf.data.augment",
    "parse_spec": "sparta_tf.data.spec",
}
"""Each public name -> the module defining it (imported on first access)."""

__all__ = [
    "DataError",
    "DataSpec",
    "Dataset",
    "SOURCES",
    "augment",
    "load_dataset",
    "make_augmenter",
    "parse_spec",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC)
