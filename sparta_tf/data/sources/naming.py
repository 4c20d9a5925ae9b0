"""Class names for sources that store only integer labels."""

from __future__ import annotations

from typing import Optional, Sequence

from sparta_tf.data.errors import key_error
from sparta_tf.data.raw import Split
from sparta_tf.data.spec import DataSpec

__all__ = ["MAX_CLASSES", "class_names_for", "names_from_labels"]

MAX_CLASSES = 100_000


def class_names_for(
    spec: DataSpec, splits: Sequence[Optional[Split]], stored: Optional[Sequence[str]] = None
) -> list[str]:
    """``data.class_names``, else names stored with the data, else ``"0" .. "K-1"``.

    ``K`` is one more than the largest label; explicit names must cover it.
    """
    labels = [split.labels for split in splits if split is not None and split.labels.size]
    needed = max((int(y.max()) + 1 for y in labels), default=0)
    if needed > MAX_CLASSES:
        raise key_error("path", f"labels go up to {needed - 1}, more than {MAX_CLASSES:,} classes",
                        "store class ids 0..K-1")
    if names_from_labels(spec, stored):
        return [str(k) for k in range(needed)]
    names, key = (list(spec.class_names), "class_names") if spec.class_names else (list(stored), "path")
    if len(names) < needed:
        raise key_error(key, f"has {len(names)} class names but labels go up to {needed - 1}",
                        f"give {needed} names")
    return names


def names_from_labels(spec: DataSpec, stored: Optional[Sequence[str]] = None) -> bool:
    """True when :func:`class_names_for` reads the number of classes off the labels."""
    return not spec.class_names and not stored
