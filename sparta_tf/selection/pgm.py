"""PGM-EST (DP-FROST, Lemmas 4-6): estimating the true partition-wise gradient magnitudes.

With ``v~_{j,i} = lambda_j v_i + N(0, sigma^2 Delta_j^2)`` observed for the
partitions ``P_i`` still in ``R_{j-1}`` at PSEL round ``j``, alternate
``v_i = sum_j v~_{j,i} lambda_j / Delta_j^2 / sum_j lambda_j^2 / Delta_j^2``
(Lemma 5) and ``lambda_j = sum_i v~_{j,i} v_i / sum_i v_i^2`` (Lemma 4);
``Var(v_i) = sigma^2 / sum_j lambda_j^2 / Delta_j^2`` (Lemma 6). Pure NumPy
post-processing of the released noisy magnitudes (no privacy cost).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["DEFAULT_J", "pgm_est", "pgm_given_lambdas", "pgm_variance"]

DEFAULT_J = 1000
"""PGM-EST's iterations ``J`` (the paper's default; not a method option)."""


def pgm_est(
    observations: np.ndarray,
    deltas: Sequence[float],
    q_ps: float,
    iterations: int = DEFAULT_J,
    tol: float = 1e-12,
) -> tuple[np.ndarray, np.ndarray]:
    """Alternating MLE of the true PGMs ``v`` and the scales ``lambda``.

    ``observations``: ``[t, M]``, ``v~_{j,i}`` or NaN where ``P_i`` was not in
    ``R_{j-1}``. ``deltas``: ``Delta_1..Delta_t``. Model: ``v~_{j,i} =
    lambda_j v_i + N(0, sigma^2 Delta_j^2)``, ``lambda_1 = q_ps`` fixed (it
    fixes the scale; Lemma 5 "given lambda_1 = q_ps"). For ``t = 1`` returns
    ``v~_1 / q_ps``. Otherwise ``lambda_2..t`` start at 1 and ``iterations``
    (``J``) rounds alternate Lemma 5 (``v``) and Lemma 4 (``lambda_j``, j >= 2),
    stopping early when ``v`` changes by at most ``tol`` (relative).
    Returns ``(v [M], lambdas [t])``.
    """
    obs = np.atleast_2d(np.asarray(observations, np.float64))
    t, m = obs.shape
    seen = np.isfinite(obs)
    if not seen[0].all():
        raise ValueError("every partition is observed in the first PSEL iteration (R_0 = S)")
    vt = np.where(seen, obs, 0.0)
    lam = np.ones(t)
    lam[0] = q_ps
    v = vt[0] / q_ps
    if t == 1:
        return v, lam
    for _ in range(int(iterations)):
        v_new = pgm_given_lambdas(obs, deltas, lam)
        # Lemma 4 (j >= 2): lambda_j = sum_{i in R_{j-1}} v~_{j,i} v_i / sum_{i in R_{j-1}} v_i^2
        # (the common 1 / Delta_j^2 cancels).
        vv = np.sum(seen[1:] * vt[1:] * v_new[None], axis=1)
        v2 = np.sum(seen[1:] * (v_new**2)[None], axis=1)
        lam[1:] = np.where(v2 > 0, vv / np.where(v2 > 0, v2, 1.0), lam[1:])
        done = np.max(np.abs(v_new - v)) <= tol * max(np.max(np.abs(v_new)), 1e-300)
        v = v_new
        if done:
            break
    return pgm_given_lambdas(obs, deltas, lam), lam  # final v consistent with the final lambdas


def pgm_given_lambdas(observations: np.ndarray, deltas: Sequence[float], lambdas: Sequence[float]) -> np.ndarray:
    """Lemma 5: ``v_i = sum_{j in T_i} v~_{j,i} lambda_j / Delta_j^2 / sum_{j in T_i} lambda_j^2 / Delta_j^2``.

    ``T_i = {j : P_i in R_{j-1}}`` (the finite entries of column ``i``).
    """
    obs = np.atleast_2d(np.asarray(observations, np.float64))
    seen = np.isfinite(obs)
    lam = np.asarray(lambdas, np.float64)[: obs.shape[0]]
    w = 1.0 / np.asarray(deltas, np.float64)[: obs.shape[0]] ** 2
    num = np.sum(np.where(seen, obs, 0.0) * (lam * w)[:, None], axis=0)
    den = np.sum(seen * (lam**2 * w)[:, None], axis=0)
    return num / den


def pgm_variance(
    noise_multiplier: float, lambdas: np.ndarray, deltas: Sequence[float], observed: np.ndarray
) -> np.ndarray:
    """Lemma 6: ``Var(v_i) = sigma^2 / sum_{j in T_i} lambda_j^2 / Delta_j^2``.

    ``observed``: bool ``[t, M]`` (``P_i in R_{j-1}``); for ``P_i in R_{t-1}`` the
    sum runs over all ``j <= t`` as in the lemma.
    """
    lam = np.asarray(lambdas, np.float64)
    w = lam**2 / np.asarray(deltas, np.float64)[: len(lam)] ** 2
    return noise_multiplier**2 / np.sum(np.asarray(observed)[: len(lam)] * w[:, None], axis=0)
