"""Banded matrix factorization (BandMF): the correlated noise of Choquette-Choo et al. (NeurIPS 2023).

**Workload.** Training's iterates are linear in the per-step gradients: ``Theta = Theta_0 - A G`` with
``G = [g_1; ...; g_T]`` and ``A`` lower-triangular. Plain SGD at rate ``eta`` has ``A = eta * 1[s <= t]``
(prefix sums); heavy-ball momentum ``m_t = beta m_{t-1} + g_t``, ``theta_t = theta_{t-1} - eta m_t``
has ``A[t, s] = eta (1 - beta^{t-s+1}) / (1 - beta)`` (:func:`workload`).

**Factorization.** With ``A = B C``, releasing ``C G + sigma C_clip Z`` (``Z`` i.i.d. standard normal) and
post-processing by ``B`` puts the noise ``sigma C_clip B Z`` on the iterates instead of DP-SGD's
``sigma C_clip A Z``. Equivalently the step adds the *correlated* noise ``w = C^{-1} z`` to its clipped
sum (:meth:`BandedFactorization.correlate`): noise that partly cancels in the iterates.

**Banded square root.** ``C`` is lower-triangular Toeplitz with ``b`` bands, ``C[t, s] = c_{t-s}`` for
``0 <= t - s < b``, where ``c_k`` are the coefficients of ``sqrt(a(x))`` for the workload's generating
function ``a(x)``: ``a(x) = 1/(1 - x)`` for SGD (``c = 1, 1/2, 3/8, 5/16, ...``), ``1/((1 - x)(1 - beta x))``
with momentum (Kalinin and Lampert, NeurIPS 2024), truncated to ``b`` terms and scaled to unit column
norm, ``sum_k c_k^2 = 1`` (:func:`banded_sqrt_coefficients`). ``b = 1`` is ``C = I``: DP-SGD exactly.

**Privacy.** One example's gradients enter ``C G`` through the columns of the steps it takes part in.
A column of a ``b``-banded ``C`` spans ``b`` rows, so participations at least ``b`` steps apart touch
disjoint rows, each with norm at most 1 (times ``C_clip``). Cyclic Poisson sampling makes that hold:
each example is put in one of ``b`` groups, uniformly and independently, and step ``t`` Poisson-samples
group ``t mod b`` at rate ``q_b = b q`` (the same expected batch; :mod:`sparta_tf.privacy.sampling`). The mechanism's privacy then reduces to
DP-SGD's: ``ceil(T / b)`` compositions of a Poisson-subsampled Gaussian at ``(q_b, sigma)``
(:func:`reduced_steps`; the rate is the plan's, :func:`sparta_tf.privacy.rates.cyclic_sample_rate`; the analysis of Choquette-Choo et al., Thm. 4).

**Error.** For a workload ``A`` the noise on the final iterate has standard deviation
``sigma C_clip ||(A C^{-1})_T||`` per coordinate (``||A_T|| = eta sqrt(T)`` for DP-SGD);
:func:`final_iterate_noise` gives it, and the caller compares factorizations at one target epsilon,
each with its own calibrated ``sigma``.
"""

from __future__ import annotations

import numpy as np


def check_bands(bands) -> int:
    """``bands`` as an int >= 1, or a ValueError naming the fix."""
    if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or bands < 1:
        raise ValueError(f"bands={bands!r} must be an integer >= 1 (1: independent noise, DP-SGD)")
    return int(bands)


def check_momentum(momentum) -> float:
    """``momentum`` as a float in ``[0, 1)``, or a ValueError naming the fix."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum!r} must be a number in [0, 1) (0: plain SGD)")
    return float(momentum)


def sqrt_series(terms: int, momentum: float = 0.0) -> np.ndarray:
    """The first ``terms`` coefficients of ``sqrt(a(x))``, ``a(x) = 1/((1 - x)(1 - beta x))``.

    ``(1 - x)^{-1/2} = sum_k binom(2k, k) / 4^k x^k``; with momentum, the product with the same series in
    ``beta x`` (a convolution)."""
    k = np.arange(terms)
    half = np.ones(terms)
    for i in range(1, terms):  # binom(2i, i)/4^i = prod_{j<=i} (2j - 1)/(2j)
        half[i] = half[i - 1] * (2 * i - 1) / (2 * i)
    if momentum == 0.0:
        return half
    return np.convolve(half, half * momentum ** k)[:terms]


def banded_sqrt_coefficients(bands: int, momentum: float = 0.0) -> np.ndarray:
    """``c_0 .. c_{b-1}``: :func:`sqrt_series` truncated to ``b`` bands, scaled to ``sum_k c_k^2 = 1``."""
    coefficients = sqrt_series(check_bands(bands), check_momentum(momentum))
    return coefficients / np.linalg.norm(coefficients)


class BandedFactorization:
    """The strategy matrix ``C`` (``b`` bands, Toeplitz, unit column norm) of a banded square root."""

    def __init__(self, bands: int, momentum: float = 0.0):
        self.bands = check_bands(bands)
        self.momentum = check_momentum(momentum)
        self.coefficients = banded_sqrt_coefficients(self.bands, self.momentum)

    def __repr__(self) -> str:
        return f"BandedFactorization(bands={self.bands}, momentum={self.momentum})"

    def matrix(self, steps: int) -> np.ndarray:
        """``C``, ``[T, T]``: ``C[t, s] = c_{t-s}`` for ``0 <= t - s < b``."""
        strategy = np.zeros((steps, steps))
        for k, c in enumerate(self.coefficients[:steps]):
            strategy += c * np.eye(steps, k=-k)
        return strategy

    def correlate(self, z: np.ndarray) -> np.ndarray:
        """``w = C^{-1} z`` for ``z: [T, ...]`` by forward substitution over the last ``b - 1`` outputs:
        ``w_t = (z_t - sum_{k=1}^{b-1} c_k w_{t-k}) / c_0``."""
        z = np.asarray(z, dtype=np.float64)
        w = np.zeros_like(z)
        c = self.coefficients
        for t in range(z.shape[0]):
            acc = z[t].copy()
            for k in range(1, min(self.bands, t + 1)):
                acc -= c[k] * w[t - k]
            w[t] = acc / c[0]
        return w

    def final_iterate_noise(self, steps: int, workload_matrix: np.ndarray | None = None) -> float:
        """``||(A C^{-1})_T||``: the final iterate's noise std per unit ``sigma C_clip``.

        ``A``: given, or the workload of SGD with this factorization's momentum at unit rates, whose
        last row ``a_s = sum_{r=s}^{T-1} beta^{r-s}`` needs no matrix: ``C^T x = a`` is then solved by
        back substitution over the bands, ``x_s = (a_s - sum_{k=1}^{b-1} c_k x_{s+k}) / c_0``, in
        ``O(T b)`` (thousands of steps in milliseconds)."""
        if workload_matrix is not None:
            last = np.linalg.solve(self.matrix(steps).T, workload_matrix[-1])  # row T of A C^{-1}: C^T x = A_T
            return float(np.linalg.norm(last))
        a = np.zeros(steps)
        running = 0.0
        for s in range(steps - 1, -1, -1):  # a_s = 1 + beta a_{s+1}
            running = 1.0 + self.momentum * running
            a[s] = running
        c = self.coefficients
        x = np.zeros(steps + self.bands)
        for s in range(steps - 1, -1, -1):
            x[s] = (a[s] - np.dot(c[1:], x[s + 1:s + self.bands])) / c[0]
        return float(np.linalg.norm(x[:steps]))


def workload(steps: int, momentum: float = 0.0, learning_rates=None) -> np.ndarray:
    """``A``, ``[T, T]``: ``theta_t = theta_0 - sum_s A[t, s] g_s`` for SGD with heavy-ball ``momentum``
    and per-step rates ``eta_t`` (default 1): ``A[t, s] = sum_{r=s}^{t} eta_r beta^{r-s}``."""
    momentum = check_momentum(momentum)
    rates = np.ones(steps) if learning_rates is None else np.asarray(learning_rates, dtype=np.float64)
    if rates.shape != (steps,):
        raise ValueError(f"learning_rates has shape {rates.shape}; give one rate per step ({steps})")
    a = np.zeros((steps, steps))
    for s in range(steps):
        decay = momentum ** np.arange(steps - s)  # beta^{r-s}, r = s..T-1
        a[s:, s] = np.cumsum(rates[s:] * decay)
    return a


def reduced_steps(steps: int, bands: int) -> int:
    """``ceil(T / b)``: the DP-SGD compositions BandMF's ``T`` steps reduce to (each example's group is
    sampled once per cycle of ``b`` steps)."""
    return -(-steps // check_bands(bands))  # integer ceiling: exact for any step count
