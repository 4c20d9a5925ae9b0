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
"""

from sparta_tf.data.augment import augment, make_augmenter
from sparta_tf.data.dataset import Dataset
from sparta_tf.data.errors import DataError
from sparta_tf.data.loader import load_dataset
from sparta_tf.data.sources import SOURCES
from sparta_tf.data.spec import DataSpec, parse_spec

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
