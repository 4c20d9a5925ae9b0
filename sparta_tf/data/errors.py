"""The one exception type of :mod:`sparta_tf.data`."""

from __future__ import annotations

import re

__all__ = ["DataError", "key_error"]


class DataError(ValueError):
    """A data spec, file or data set is unusable; the message is one line naming the fix."""

    def under(self, section: str) -> "DataError":
        """The same error for a data spec that lives under ``section`` (e.g. ``pretrain.data``)."""
        return DataError(re.sub(r"(?<![\w.])data(?=[.:])", section, str(self)))


def key_error(key: str, problem: str, fix: str) -> DataError:
    """Builds ``DataError("data.<key>: <problem>; <fix>")`` on a single line."""
    text = f"data.{key}: {problem}; {fix}"
    return DataError(" ".join(text.split()))
