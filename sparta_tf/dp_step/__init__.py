"""The DP step from small parts: what one call of ``DPModel.train_step`` computes.

One step is one Poisson-subsampled Gaussian mechanism (Abadi et al. 2016) over the trainable set::

    engine      g_i (or only their clipped sum)           per example i of the batch B_t
    keep        I_s = keep(t) within the trainable set     (every coordinate; DP-SSGD: drop some)
    clip        c_i = min(1, C / ||g_i[I_s]||_2)           per example
    sum         S_t = sum_micro-batches sum_i c_i g_i[I_s], all-reduced over replicas
    noise       S~_t = S_t + N(0, sigma^2 C^2 I)           (on I_s)
    normalise   g~_t = S~_t / (q n)                        the expected batch size
    release     theta <- optimizer(theta, g~_t) on I_s     or SPARTA: accumulate noisy scores

Each line is a small object of its own module, with its math in its docstring:

* :func:`sparta_tf.per_example.make_engine`: which per-example engine computes ``g_i`` or ``S``;
* :mod:`~sparta_tf.dp_step.keep`: the gradient filter ("mask or drop"): :data:`KEEP_ALL`, or a
  method's filter such as DP-SSGD's :class:`~sparta_tf.ssgd.dropping.GradientDropping`;
* :mod:`~sparta_tf.dp_step.clip`: :class:`ClippedSum`, the per-(micro-)batch clipped sum;
* :mod:`~sparta_tf.dp_step.micro_batches`: :class:`MicroBatches`, the sum over micro-batches and
  replicas;
* :mod:`~sparta_tf.dp_step.noise` and :mod:`~sparta_tf.dp_step.normalise`: :class:`GaussianNoise`,
  :class:`ExpectedBatchNormalisation`;
* :mod:`~sparta_tf.dp_step.release`: :class:`GradientRelease` (noisy gradient -> optimizer) or
  :class:`ScoreRelease` (SPARTA's noisy mask scores, no weight update);
* :mod:`~sparta_tf.dp_step.parts`: :class:`StepParts`, the parts one traced step runs with.

A method plugs its part into a :class:`~sparta_tf.DPModel` (``dp.set_release(...)``,
``dp.set_gradient_filter(...)``) between phases; the parts hold configuration only, and the
values of a step (its keep masks, sums, noise) flow through arguments and return values, so
nothing is assigned while the step is traced.

The package imports its parts on first use (PEP 562 ``__getattr__``): the lower layers
(:mod:`sparta_tf.per_example` uses :mod:`~sparta_tf.dp_step.clipping`) import one part without
importing the parts that build on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparta_tf.lazy_exports import lazy_exports

if TYPE_CHECKING:  # for type checkers and the API reference; at run time __getattr__ imports them
    from sparta_tf.dp_step.clip import BatchStatistic, ClippedSum
    from sparta_tf.dp_step.keep import KEEP_ALL, GradientFilter, KeepAll
    from sparta_tf.dp_step.micro_batches import MicroBatches, all_reduce_sum
    from sparta_tf.dp_step.noise import GaussianNoise
    from sparta_tf.dp_step.normalise import ExpectedBatchNormalisation
    from sparta_tf.dp_step.parts import StepParts
    from sparta_tf.dp_step.release import GradientRelease, Release, ScoreRelease

_PARTS: dict[str, str] = {
    "BatchStatistic": "sparta_tf.dp_step.clip",
    "ClippedSum": "sparta_tf.dp_step.clip",
    "KEEP_ALL": "sparta_tf.dp_step.keep",
    "GradientFilter": "sparta_tf.dp_step.keep",
    "KeepAll": "sparta_tf.dp_step.keep",
    "MicroBatches": "sparta_tf.dp_step.micro_batches",
    "all_reduce_sum": "sparta_tf.dp_step.micro_batches",
    "GaussianNoise": "sparta_tf.dp_step.noise",
    "ExpectedBatchNormalisation": "sparta_tf.dp_step.normalise",
    "StepParts": "sparta_tf.dp_step.parts",
    "GradientRelease": "sparta_tf.dp_step.release",
    "Release": "sparta_tf.dp_step.release",
    "ScoreRelease": "sparta_tf.dp_step.release",
}
"""Each exported name -> the module of the part defining it."""

__all__ = [
    "BatchStatistic",
    "ClippedSum",
    "ExpectedBatchNormalisation",
    "GaussianNoise",
    "GradientFilter",
    "GradientRelease",
    "KEEP_ALL",
    "KeepAll",
    "MicroBatches",
    "Release",
    "ScoreRelease",
    "StepParts",
    "all_reduce_sum",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _PARTS)
