"""The run-level choices a user names by string, in one TensorFlow-free place.

The library checks them where they are used (the accountant in :mod:`sparta_tf.privacy.accounting`,
the sampling mode in :class:`~sparta_tf.DPModel`, the engine in
:func:`sparta_tf.per_example.make_engine`, the strategy in :mod:`sparta_tf.distribute`), and
``sparta-train``'s config checker (:mod:`trainers.config`, which imports no TensorFlow) checks a
config against the same tuples. Standard library only. The first value of each is the default.
"""

import numbers

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
"""dp-accounting's privacy-loss-distribution accountant (tight) or its RDP accountant."""

SAMPLING_MODES: tuple[str, ...] = ("poisson", "shuffle")
"""Poisson sampling (what the accountant assumes) or shuffled fixed-size batches (not covered)."""

ENGINES: tuple[str, ...] = ("auto", "bookkeeping", "layerwise", "vectorized")
"""The per-example engines (:func:`sparta_tf.per_example.make_engine`)."""

STRATEGIES: tuple[str, ...] = ("default", "mirrored", "multi_worker")
"""The ``tf.distribute`` strategies a run can use (:mod:`sparta_tf.distribute`)."""

def one_of_problem(value, options: tuple) -> str | None:
    """What is wrong with ``value`` as one of ``options`` (None: it is one)."""
    return None if value in options else f"must be one of {', '.join(map(str, options))}"


CANDIDATE_DISTRIBUTIONS: dict[str, float] = {"geometric": 1.0, "logarithmic": 0.0, "poisson": float("inf")}
"""The distributions of a private tuning's number of candidates that have a name, by their shape
(:class:`sparta_tf.privacy.tuning.CandidateCount`; any other shape in ``(0, inf)`` is a truncated
negative binomial)."""


def candidate_shape(shape) -> float:
    """``shape`` (a number ``>= 0``, ``"inf"``, or a name of :data:`CANDIDATE_DISTRIBUTIONS`) as a float in
    ``[0, inf]``, else a one-line ValueError."""
    if isinstance(shape, str):
        if shape in ("inf", "infinity"):
            return float("inf")
        if shape not in CANDIDATE_DISTRIBUTIONS:
            raise ValueError(f"shape={shape!r}: give a number >= 0 (0 logarithmic, 1 geometric, inf Poisson, "
                             f"else a truncated negative binomial) or one of {sorted(CANDIDATE_DISTRIBUTIONS)}")
        return CANDIDATE_DISTRIBUTIONS[shape]
    if isinstance(shape, bool) or not isinstance(shape, numbers.Real) or shape != shape or shape < 0:
        raise ValueError(f"shape={shape!r} must be a number >= 0 (0 logarithmic, 1 geometric, inf Poisson, "
                         "else a truncated negative binomial)")
    return float(shape)


def candidate_mean(mean, shape: float) -> float:
    """``mean`` (of the number of candidates, for the distribution of ``shape``) as a float, else a one-line
    ValueError: dp-accounting's analysis needs ``mean >= 1``, and only the geometric and Poisson
    distributions have mean 1 without being a single run."""
    if isinstance(mean, bool) or not isinstance(mean, numbers.Real) or not 1 <= mean < float("inf"):
        raise ValueError(f"mean={mean!r} must be a number >= 1 (the mean number of candidate runs, e.g. 5)")
    if shape != float("inf") and mean == 1 and shape != 1:
        raise ValueError("mean=1 is one run: give a mean > 1")
    return float(mean)


MEMORY_UNITS: dict[str, int] = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                                "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
"""The units a memory size may be written in (``"512MiB"``, ``"2GB"``)."""


def memory_bytes(size, name: str = "max_memory") -> int | None:
    """``size`` (bytes as a number ``>= 0``, a string such as ``"2GiB"``, or None: the default) as an
    int number of bytes or None, else a one-line ValueError naming ``name``."""
    if size is None:
        return None
    if isinstance(size, str):
        text = size.strip()
        unit = next((u for u in sorted(MEMORY_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        number = text[: len(text) - len(unit)].strip() if unit else text
        try:
            value = float(number) * MEMORY_UNITS[unit or "B"]
        except ValueError:
            value = float("nan")
    elif isinstance(size, bool) or not isinstance(size, numbers.Real):
        value = float("nan")
    else:
        value = float(size)
    if value != value or value < 0 or value == float("inf"):
        raise ValueError(f"{name}={size!r}: give a size in bytes >= 0, e.g. 2000000000 or '2GiB' "
                         f"(units {', '.join(MEMORY_UNITS)}), or leave it unset for the machine's default")
    return int(value)
