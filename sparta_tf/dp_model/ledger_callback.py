"""The privacy callback a ``DPModel.fit`` charges its ledger with.

Every DP step is one Poisson-subsampled Gaussian mechanism ``M_{q, sigma}``; the
:class:`~sparta_tf.privacy.callbacks.PrivacyCallback` records the steps the model's ``dp_step``
counted into the model's :class:`~sparta_tf.privacy.ledger.PrivacyLedger`, with the ``sigma`` and
``q`` the model runs with. A caller's own callback is accepted only when it records those values,
and ``fit`` refuses to start when the ledger holds fewer steps than ``dp_step`` (a restored
checkpoint without its ledger), so that epsilon never leaves steps out.
"""

from __future__ import annotations

import math

from sparta_tf.masks import is_mask_charge
from sparta_tf.privacy.callbacks import PrivacyCallback


def privacy_callback(dp, callbacks, steps_per_epoch, on_budget_exhausted):
    """The caller's :class:`PrivacyCallback`, else this model's own, one for every ``fit``.

    One callback for the model's life: it counts ``dp_step`` from its last record, so the
    steps of a ``fit`` that ended in an exception (no ``on_epoch_end`` / ``on_train_end``)
    are recorded when the next ``fit`` begins, with the values in force when they ran.
    """
    existing = [c for c in callbacks if isinstance(c, PrivacyCallback)]
    if existing or dp.ledger is None:
        if existing:
            check_caller_callback(dp, existing[0])
            check_ledger_covers_dp_step(dp, existing[0])
        return existing[0] if existing else None
    own = dp.privacy_callback
    budget_mode = "strict" if dp.private_run is None else dp.private_run.budget_mode
    if own is None or own.ledger is not dp.ledger or own.step_counter is not dp.dp_step:
        own = PrivacyCallback(
            dp.ledger, dp.noise_multiplier, dp.sample_rate, steps_per_epoch,
            step_counter=dp.dp_step, on_budget_exhausted=on_budget_exhausted, budget_mode=budget_mode,
        )
    else:
        own.flush()  # an interrupted fit's steps, under the values they ran with
        own.noise_multiplier, own.sample_rate = dp.noise_multiplier, dp.sample_rate
        own.steps_per_epoch = steps_per_epoch
        own.on_budget_exhausted = on_budget_exhausted
        own.budget_mode = budget_mode
    check_ledger_covers_dp_step(dp, own)
    return own

def check_caller_callback(dp, callback: PrivacyCallback) -> None:
    """A caller's :class:`PrivacyCallback` records what this model's steps run with: the same
    ``sigma`` and ``q`` (and the model's step counter), or epsilon would describe another mechanism."""
    problems = []
    if not math.isclose(callback.noise_multiplier, dp.noise_multiplier, rel_tol=1e-12):
        problems.append(f"noise_multiplier {callback.noise_multiplier:g} (the model's: {dp.noise_multiplier:g})")
    if not math.isclose(callback.sample_rate, dp.sample_rate, rel_tol=1e-12):
        problems.append(f"sample_rate {callback.sample_rate:g} (the model's: {dp.sample_rate:g})")
    if callback.step_counter is not None and callback.step_counter is not dp.dp_step:
        problems.append("a step_counter other than the model's dp_step")
    if problems:
        raise ValueError(f"the PrivacyCallback passed to fit records {' and '.join(problems)}; leave it out "
                         "(the model charges its own ledger from the values it runs with) or make it agree")

def check_ledger_covers_dp_step(dp, callback: PrivacyCallback) -> None:
    """``dp_step`` counts every DP step this model's weights have been through; the ledger must
    hold at least as many (recorded or pending), or epsilon would leave steps out: e.g. after
    ``checkpoint_state()`` was restored into a new DPModel whose ledger starts empty."""
    if callback.ledger is not dp.ledger or callback.step_counter is not dp.dp_step:
        return
    recorded = sum(entry.count for entry in dp.ledger.entries
                   if entry.kind == callback.kind and not is_mask_charge(entry))
    ran = int(dp.dp_step.numpy())
    if recorded + callback.pending_steps() < ran:
        raise ValueError(
            f"dp_step is {ran} but the privacy ledger records {recorded} DP steps: restore the ledger "
            "saved with the checkpoint (dp_model.ledger = PrivacyLedger.from_json(...)) before fit, "
            "or epsilon would leave the other steps out"
        )
