"""What every sparse method shares: a mask of kernel rows (or entries) on top of the DP-BitFit set.

A sparse method trains biases + norms + head (:data:`ALWAYS_TRAINABLE`)
plus, in every maskable kernel, the rows or entries its mask keeps (a
``density`` fraction per layer, at least one; ``density_overrides`` per layer
name pattern, each of which must match a maskable layer). The mask is saved to ``mask_dir`` (``mask.npz/json/md``) with
its privacy provenance (:class:`sparta_tf.masks.MaskProvenance`); a resumed
run reloads its own saved mask rather than choosing again.
"""

from __future__ import annotations

import fnmatch
import tensorflow as tf

from sparta_tf import masks
from sparta_tf.groups import row_groups
from sparta_tf.methods.base import SetMethod
from sparta_tf.methods.sets import ALWAYS_TRAINABLE, role_set
from sparta_tf.selection.topk import density_for, kept_count
from sparta_tf.trainable import TrainableSet, VariableSelection

MAX_LISTED_LAYERS = 8


class MaskedMethod(SetMethod):
    """A method whose final trainable set is the DP-BitFit set plus a kernel mask; its spec has the mask
    options ``density``, ``granularity`` and ``density_overrides`` (attributes of the same names)."""

    mask_selections: list[VariableSelection] | None = None
    """The mask once chosen (or reloaded), else None."""

    def check(self, model: tf.keras.Model) -> None:
        """Refuses a ``density_overrides`` pattern that matches no maskable layer of ``model`` (it would
        change nothing, silently): one line naming the pattern and the layers there are."""
        super().check(model)
        if not self.density_overrides:
            return
        groups = row_groups(model, self.head)
        for pattern in self.density_overrides:
            if not any(fnmatch.fnmatchcase(g.layer, pattern) or fnmatch.fnmatchcase(g.name, pattern) for g in groups):
                layers = list(dict.fromkeys(g.layer for g in groups))
                shown = ", ".join(layers[:MAX_LISTED_LAYERS]) + (", ..." if len(layers) > MAX_LISTED_LAYERS else "")
                raise ValueError(f"density_overrides pattern {pattern!r} matches no maskable layer (fnmatch on the "
                                 f"layer or variable name); the model's are: {shown}; fix or remove the pattern")

    def masked_set(self, model: tf.keras.Model) -> TrainableSet:
        """The DP-BitFit set plus the mask (which must be known)."""
        if self.mask_selections is None:
            raise ValueError(f"method {self.name!r} has no mask yet")
        return role_set(model, ALWAYS_TRAINABLE, self.mask_selections, self.head, self.head_learning_rate_scale)

    def expected_masked_size(self, model: tf.keras.Model) -> int:
        """Coordinates of the masked set before the mask is known: the kept count per layer is fixed."""
        total = role_set(model, ALWAYS_TRAINABLE, (), self.head).size
        for group in row_groups(model, self.head):
            density = density_for(group, self.density, self.density_overrides)
            if self.granularity == "row":
                total += kept_count(group.n_rows, density) * group.row_size
            else:
                total += kept_count(group.n_rows * group.row_size, density)
        return total

    def save_mask(self, model: tf.keras.Model, provenance: masks.MaskProvenance, **labels) -> None:
        if self.mask_dir is not None and self.mask_selections is not None:
            masks.save_mask(self.mask_dir, self.mask_selections, model, provenance=provenance, method=self.name,
                            granularity=self.granularity, density=self.density, **labels)

    def reload_own_mask(self, model: tf.keras.Model) -> bool:
        """A resumed run: the mask this run saved before it was interrupted (already accounted for)."""
        if not masks.has_mask(self.mask_dir):
            return False
        self.mask_selections, _ = masks.load_mask(self.mask_dir, model)
        return True
