"""What correlated noise buys a run, before it runs: the noise on the final weights for each number of bands.

For a run planned with ``b`` bands at the plan's target epsilon (each plan calibrates its own ``sigma_b``
for cyclic Poisson sampling and ``ceil(T_p / b)`` charged steps per phase), the noise the training leaves
on the final weights has standard deviation, per trainable coordinate and in units of ``C_clip`` times the
learning rate::

    e_b = sigma_b ||(A C_b^{-1})_T||        (A: SGD with the optimizer's momentum over the T updating steps)

(:meth:`~sparta_tf.privacy.banded.BandedFactorization.final_iterate_noise`); ``b = 1`` is DP-SGD's
``sigma_1 ||A_T||``. :func:`compare_bands` gives ``e_b / e_1`` for ``b = 1, 2, 4, ...`` up to ``1 / q``;
the smallest ratio is the number of bands to choose. The measure leaves out the learning-rate schedule
(constant rate) and treats the updating phases as one sequence of ``T`` steps; it is the quantity the
BandMF papers optimise, not a prediction of accuracy.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from sparta_tf.privacy.banded import BandedFactorization

CANDIDATE_BANDS = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class BandsError:
    """``bands``: its calibrated ``noise_multiplier`` and the final-weights noise ``ratio`` ``e_b / e_1``."""

    bands: int
    noise_multiplier: float
    ratio: float


def compare_bands(plan_with_bands: Callable[[int], object], momentum: float = 0.0,
                  candidates: Sequence[int] = CANDIDATE_BANDS) -> list[BandsError]:
    """``e_b / e_1`` (module doc) for each candidate ``b`` the run admits (``b q <= 1``, every phase at
    least ``b`` steps); ``plan_with_bands(b)``: the run's plan with ``b`` bands (a ValueError skips ``b``)."""
    errors = []
    for bands in candidates:
        try:
            plan = plan_with_bands(bands)
        except ValueError:
            if bands == 1:
                raise
            continue
        steps = max(plan.update_steps, 1)
        noise = plan.noise_multiplier * BandedFactorization(bands, momentum).final_iterate_noise(steps)
        errors.append((bands, plan.noise_multiplier, noise))
    reference = errors[0][2]
    return [BandsError(b, sigma, noise / reference) for b, sigma, noise in errors]


def describe_comparison(errors: Sequence[BandsError], chosen: int) -> str:
    """The dry run's lines: each ``b`` with its noise multiplier and ratio, the best marked."""
    best = min(errors, key=lambda e: e.ratio)
    cells = ", ".join(f"b={e.bands}: {e.ratio:.3f} (sigma {e.noise_multiplier:.3g})" for e in errors)
    advice = (f"bands={best.bands} minimises it" + ("" if best.bands == chosen else
                                                     f"; this run uses bands={chosen}"))
    return (f"correlated noise (privacy.bands): noise on the final weights against independent noise at the same "
            f"epsilon: {cells}; {advice}")
