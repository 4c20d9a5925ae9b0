"""Everything about a run's privacy: one package.

* :mod:`~sparta_tf.privacy.plan`: the run's :class:`PrivacyPlan` (the only place ``sigma`` and ``q``
  are computed), through :mod:`~sparta_tf.privacy.calibration`;
* :mod:`~sparta_tf.privacy.mechanism`: :class:`DpSgdMechanism`, the one frozen description of a DP step;
* :mod:`~sparta_tf.privacy.accounting`: epsilon of dp-accounting events;
* :mod:`~sparta_tf.privacy.ledger`: the :class:`PrivacyLedger` of what ran;
* :mod:`~sparta_tf.privacy.callbacks` and :mod:`~sparta_tf.privacy.charging`: how a ``fit``'s steps
  (resumed ones included) are charged to the ledger;
* :mod:`~sparta_tf.privacy.sampling` / :mod:`~sparta_tf.privacy.shuffling`: Poisson (and shuffled) batches.
"""

from sparta_tf.privacy.accounting import (
    ACCOUNTANTS,
    PrivacyBudgetExceededError,
    compute_epsilon,
    dp_sgd_event,
    epsilon_of_event,
    gaussian_step_event,
    make_accountant,
)
from sparta_tf.privacy.calibration import calibrate_noise_multiplier
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.sampling import (
    PoissonSampler,
    default_physical_batch_size,
    poisson_dataset,
    steps_per_epoch,
)
from sparta_tf.privacy.shuffling import shuffled_dataset, shuffled_steps_per_epoch

__all__ = [
    "ACCOUNTANTS",
    "DpSgdMechanism",
    "LedgerEntry",
    "PoissonSampler",
    "PrivacyBudgetExceededError",
    "PrivacyCallback",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "default_physical_batch_size",
    "dp_sgd_event",
    "epsilon_of_event",
    "gaussian_step_event",
    "make_accountant",
    "poisson_dataset",
    "shuffled_dataset",
    "shuffled_steps_per_epoch",
    "steps_per_epoch",
]
