"""The in-memory data set handed to the trainer."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["Dataset"]


@dataclasses.dataclass
class Dataset:
    """Train/validation/test arrays of one image-classification data set.

    ``x_*`` are float32 ``[N, H, W, C]`` images scaled to ``[0, 1]`` and then,
    when the spec asked for ``normalize: standard``, standardised per channel
    with ``mean`` and ``std`` (computed on ``x_train`` only, or taken from the
    spec; both ``None`` without normalisation). ``y_*`` are int64 class ids in
    ``0 .. num_classes - 1``; ``class_names[k]`` names class ``k``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: list[str]
    name: str
    mean: Optional[np.ndarray] = None
    std: Optional[np.ndarray] = None
    users_train: Optional[np.ndarray] = None
    """Each training example's user id (strings; ``data.user_key``), None without user ids; likewise
    ``users_val`` and ``users_test``. A user's examples are all in one split."""
    users_val: Optional[np.ndarray] = None
    users_test: Optional[np.ndarray] = None
    statistics_from_private_data: bool = False
    """True when ``mean``/``std`` were computed from ``x_train`` without noise: a release of the
    private data that no DP accounting covers (a run using them is reported NOT private: ``sparta-train``,
    and ``make_private(..., data=dataset)``)."""

    class_count_from_private_labels: bool = False
    """True when ``num_classes`` is one more than the largest label in the data (no ``data.classes``
    or ``data.class_names``, none stored): one example of the top class can change it, and with
    it the model's head, unless the label set is public knowledge (a caveat, not a refusal)."""

    channels_from_private_data: bool = False
    """True when the images' channel count (the model's input shape) was read off one private image (an image
    tree's first file) and ``data.channels`` did not fix it."""

    split_caveats: tuple[str, ...] = ()
    """What the held-out splits assume (:func:`sparta_tf.data.load_dataset`): splits by position, a known
    split key, a limit that can displace an example."""

    stored_image_digests: Optional[dict] = None
    """``{"train": ..., "val": ..., "test": ...}``: a set of digests of each split's images as the source
    stores them (decoded pixels, before scaling, channel conversion, resizing and normalisation), so that
    two data sections that load the same images differently can still be compared; None when not known."""

    def privacy_caveats(self) -> list[str]:
        """What the DP guarantee assumes of this data set beyond the mechanism (empty: nothing)."""
        caveats = list(self.split_caveats)
        if self.class_count_from_private_labels:
            caveats.append(f"the number of classes ({self.num_classes}) was read off the private labels, so one "
                           "example of the top class can change the model's head; the guarantee assumes the label set "
                           "is public: give data.classes or data.class_names")
        if self.channels_from_private_data:
            caveats.append("the images' channel count (the model's input shape) was read off the first private "
                           "image, so one image can change it; the guarantee assumes it is public: give "
                           "data.channels")
        return caveats

    def nonprivate_reasons(self) -> list[str]:
        """Why training on this data set is not covered by the DP guarantee (empty: it is)."""
        if not self.statistics_from_private_data:
            return []
        return ["data.normalize: standard computed mean/std from the private training split without noise; "
                "pass data.mean and data.std computed on public data"]

    @property
    def user_count(self) -> Optional[int]:
        """The number of distinct users in the training split (None without user ids)."""
        return None if self.users_train is None else len(np.unique(self.users_train))

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The shape ``(H, W, C)`` of one image."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes}, train={len(self.y_train)}, "
            f"val={len(self.y_val)}, test={len(self.y_test)}, "
            f"normalized={self.mean is not None})"
        )
