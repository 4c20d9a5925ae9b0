"""The sample rates of a run, computed here and nowhere else (the plan and the sampler read them).

* ``q = min(1, B / n)``: the Poisson rate of an expected batch ``B`` on ``n`` examples;
* ``q_b = b q``: under cyclic Poisson sampling with ``b`` groups (BandMF), the rate at which a step
  samples the examples of its group, for the same expected batch.
"""

from __future__ import annotations

from sparta_tf.privacy.banded import check_bands


def sample_rate(n: int, expected_batch_size: float) -> float:
    """``q = min(1, b / n)``: the Poisson rate of a run with expected batch ``b`` on ``n`` examples (the
    only place ``q`` is computed; everything else reads the plan's)."""
    if n < 1:
        raise ValueError(f"n={n} private training examples: need at least 1")
    return min(1.0, expected_batch_size / n)


def cyclic_sample_rate(sample_rate: float, bands: int) -> float:
    """``q_b = b q``: the rate at which a step of cyclic Poisson sampling samples its group, each example
    in one of ``b`` groups drawn independently and uniformly (:mod:`sparta_tf.privacy.sampling`), so
    a step's expected batch is ``q n`` as without bands (ValueError when ``b q > 1``)."""
    bands = check_bands(bands)
    rate = sample_rate * bands
    if rate > 1.0 + 1e-12:
        raise ValueError(f"bands={bands} needs a sampling rate of {rate:.3g} per group (bands x q), above 1: keep "
                         f"bands <= {max(1, int(1 / sample_rate + 1e-9))} (1 / q) or lower the batch size")
    return min(rate, 1.0)
