"""The run-level choices a user names by string, in one TensorFlow-free place.

The library checks them where they are used (the accountant in :mod:`sparta_tf.privacy.accounting`,
the sampling mode in :class:`~sparta_tf.DPModel`, the engine in
:func:`sparta_tf.per_example.make_engine`, the strategy in :mod:`sparta_tf.distribute`), and
``sparta-train``'s config checker (:mod:`trainers.config`, which imports no TensorFlow) checks a
config against the same tuples. Standard library only. The first value of each is the default.
"""

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
"""dp-accounting's privacy-loss-distribution accountant (tight) or its RDP accountant."""

SAMPLING_MODES: tuple[str, ...] = ("poisson", "shuffle")
"""Poisson sampling (what the accountant assumes) or shuffled fixed-size batches (not covered)."""

ENGINES: tuple[str, ...] = ("auto", "bookkeeping", "layerwise", "vectorized")
"""The per-example engines (:func:`sparta_tf.per_example.make_engine`)."""

STRATEGIES: tuple[str, ...] = ("default", "mirrored", "multi_worker")
"""The ``tf.distribute`` strategies a run can use (:mod:`sparta_tf.distribute`)."""
