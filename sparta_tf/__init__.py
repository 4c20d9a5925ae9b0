"""sparta-tf: differentially private (sparse) fine-tuning for TensorFlow/Keras."""

from sparta_tf.dp_model import DPModel
from sparta_tf.model_checks import NotPerExampleSafeError
from sparta_tf.privacy import (
    PoissonSampler,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
)

__version__ = "0.1.0"

__all__ = [
    "DPModel",
    "NotPerExampleSafeError",
    "PoissonSampler",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compute_epsilon",
]
