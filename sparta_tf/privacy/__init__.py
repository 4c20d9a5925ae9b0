"""Privacy accounting (dp-accounting), the privacy ledger, Poisson sampling (and shuffled batches)."""

from sparta_tf.privacy.accounting import (
    ACCOUNTANTS,
    PrivacyBudgetExceededError,
    calibrate_noise_multiplier,
    compute_epsilon,
    dp_sgd_event,
    epsilon_of_event,
    gaussian_step_event,
    make_accountant,
)
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger
from sparta_tf.privacy.sampling import (
    PoissonSampler,
    default_physical_batch_size,
    poisson_dataset,
    steps_per_epoch,
)
from sparta_tf.privacy.shuffling import shuffled_dataset, shuffled_steps_per_epoch

__all__ = [
    "ACCOUNTANTS",
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
