"""The privacy and training plan of a run (what ``--dry-run`` prints).

For ``n`` private training examples and expected batch ``b``: ``q = b / n``,
``round(1/q)`` steps per epoch, ``T`` epochs; ``sigma`` is calibrated so that
all ``T`` epochs together spend at most the target epsilon (SPARTA's
selection epoch is one of them). Epsilon per phase is the cumulative epsilon
at the end of each phase.
"""

from __future__ import annotations

import dataclasses

from sparta_tf.privacy import PrivacyLedger, calibrate_noise_multiplier, steps_per_epoch


@dataclasses.dataclass
class Phase:
    name: str
    epochs: int
    trainable: int | None = None  # trainable coordinates (None: known after selection)
    epsilon_after: float = 0.0


@dataclasses.dataclass
class Plan:
    n: int
    sample_rate: float
    steps_per_epoch: int
    epochs: int
    noise_multiplier: float
    delta: float
    target_epsilon: float
    accountant: str
    total_parameters: int
    phases: list[Phase]

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"steps": self.steps}

    def describe(self) -> str:
        lines = [
            f"private training examples n = {self.n}",
            f"sample rate q = {self.sample_rate:.6g} (expected batch {self.sample_rate * self.n:.1f}), "
            f"{self.steps_per_epoch} steps/epoch, {self.epochs} epochs = {self.steps} steps",
            f"noise multiplier sigma = {self.noise_multiplier:.6g} "
            f"(target epsilon {self.target_epsilon:g}, delta {self.delta:g}, {self.accountant})",
            "phase          epochs   trainable parameters        epsilon at end",
        ]
        for phase in self.phases:
            if phase.trainable is None:
                trainable = "selected privately"
            else:
                trainable = f"{phase.trainable:,} ({phase.trainable / self.total_parameters:.2%})"
            lines.append(f"{phase.name:<14} {phase.epochs:>6}   {trainable:<27} {phase.epsilon_after:.4g}")
        return "\n".join(lines)


def make_plan(
    config: dict,
    n: int,
    phase_sizes: list[tuple[str, int, int | None]],
    total_parameters: int,
    noise_multiplier: float | None = None,
    prior: list[tuple[str, float, float, int]] = (),
) -> Plan:
    """``phase_sizes``: ``(name, epochs, trainable coordinates or None)`` in order.

    ``prior``: mechanisms charged before training, ``(phase, sigma, q, count)``
    (DP-FROST's selection, DP-SNIP); ``noise_multiplier``: the training sigma
    when the method chose it (default: calibrated for the training steps alone).
    """
    privacy, training = config["privacy"], config["training"]
    q = min(1.0, training["batch_size"] / n)
    per_epoch = steps_per_epoch(q)
    epochs = training["epochs"]
    sigma = noise_multiplier if noise_multiplier is not None else privacy["noise_multiplier"]
    if sigma is None:
        sigma = calibrate_noise_multiplier(privacy["target_epsilon"], privacy["delta"], q, epochs * per_epoch,
                                           accountant=privacy["accountant"])
    ledger = PrivacyLedger(privacy["delta"], accountant=privacy["accountant"])
    phases = []
    for name, prior_sigma, prior_q, count in prior:
        ledger.record(prior_sigma, prior_q, count, phase=name)
        phases.append(Phase(name, 0, 0, ledger.epsilon()))
    for name, phase_epochs, trainable in phase_sizes:
        ledger.record(sigma, q, phase_epochs * per_epoch, phase=name)
        phases.append(Phase(name, phase_epochs, trainable, ledger.epsilon()))
    return Plan(n, q, per_epoch, epochs, float(sigma), privacy["delta"], privacy["target_epsilon"],
                privacy["accountant"], total_parameters, phases)
