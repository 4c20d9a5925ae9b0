"""What an example-level guarantee says about a person with several examples: group privacy.

An (epsilon, delta)-DP mechanism over examples is, for a group of ``k`` examples (one person's),
``(k epsilon, delta_k)``-DP with::

    delta_k = delta * sum_{i=0}^{k-1} e^{i epsilon} = delta (e^{k epsilon} - 1) / (e^epsilon - 1)

(chain the neighbouring datasets ``D_0, ..., D_k`` one example apart:
``P[M(D_0) in S] <= e^epsilon P[M(D_1) in S] + delta`` applied ``k`` times; Dwork and Roth 2014,
Thm. 2.2 states the looser ``k e^{(k-1) epsilon} delta``). This is what a run at example level can
claim for a person, and why user-level DP (the person as the unit, :mod:`sparta_tf.privacy.user_sampling`)
exists: at ``epsilon = 4`` a person with 10 examples is left with ``epsilon = 40``.
"""

from __future__ import annotations

import math
import numbers


def group_guarantee(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """``(k epsilon, delta_k)`` for a group of ``k = group_size`` examples (module doc); ``delta_k`` may
    exceed 1 (then the guarantee says nothing about the group), and is ``inf`` when it overflows."""
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an integer >= 1 (examples of one person)")
    if not (epsilon >= 0 and math.isfinite(epsilon)) or not 0 <= delta <= 1:
        raise ValueError(f"need a finite epsilon >= 0 and delta in [0, 1], got epsilon={epsilon!r}, delta={delta!r}")
    k = int(group_size)
    if epsilon == 0:
        return 0.0, min(k * delta, math.inf)
    try:
        delta_k = delta * math.expm1(k * epsilon) / math.expm1(epsilon)
    except OverflowError:
        delta_k = math.inf if delta > 0 else 0.0
    return k * epsilon, delta_k


def describe_group_guarantee(epsilon: float, delta: float, group_size: int) -> str:
    """One clause for the dry run: what an example-level ``(epsilon, delta)`` leaves a person with
    ``group_size`` examples."""
    group_epsilon, group_delta = group_guarantee(epsilon, delta, group_size)
    for_them = ("says nothing about them (delta >= 1)" if group_delta >= 1 else
                f"leaves them (epsilon {group_epsilon:.3g}, delta {group_delta:.3g})")
    return (f"an example-level run at (epsilon {epsilon:g}, delta {delta:g}) covers a person with {group_size} "
            f"examples only through group privacy, which {for_them}")
