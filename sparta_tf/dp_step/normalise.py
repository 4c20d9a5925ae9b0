"""The normalisation of a DP-SGD step by the expected batch size.

With Poisson sampling at rate ``q`` from ``n`` examples the batch size is random; the step
divides by its expectation, not by the realised size (which would depend on the data)::

    g~_t = S~_t / (q n)
"""

from __future__ import annotations


class ExpectedBatchNormalisation:
    """``S~ -> S~ / (q n)`` (see the module doc)."""

    def __init__(self, sample_rate: float, dataset_size: int | None):
        self.sample_rate = sample_rate
        self.dataset_size = dataset_size

    def __call__(self, noisy_sums: list) -> list:
        if self.dataset_size is None:
            raise ValueError("dataset_size is unknown: pass DPModel(dataset_size=n) or fit arrays")
        expected_batch = self.sample_rate * self.dataset_size
        return [s / expected_batch for s in noisy_sums]
