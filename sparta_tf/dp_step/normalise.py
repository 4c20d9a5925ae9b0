"""The normalisation of a DP-SGD step by the expected batch size.

With Poisson sampling at rate ``q`` from ``n`` examples the batch size is random; the step
divides by its expectation, not by the realised size (which would depend on the data)::

    g~_t = S~_t / (q n)

``q`` and ``n`` are the model's :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`'s.
"""

from __future__ import annotations


class ExpectedBatchNormalisation:
    """``S~ -> S~ / (q n)``, ``q n`` from ``mechanism`` (see the module doc)."""

    def __init__(self, mechanism):
        self.mechanism = mechanism

    def __call__(self, noisy_sums: list) -> list:
        expected_batch = self.mechanism.expected_batch_size
        return [s / expected_batch for s in noisy_sums]
