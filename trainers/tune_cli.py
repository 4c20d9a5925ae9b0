"""``sparta-tune --config configs/NAME.yaml [--set section.key=value ...] [--dry-run] [--resume]``.

Private hyperparameter tuning: a random number of ``sparta-train`` runs of the config, each with values
drawn from the ``tuning`` section's space, the best released; the whole procedure meets the config's
``privacy.target_epsilon`` (:mod:`trainers.tune`). ``--dry-run`` prints each candidate's budget and
noise and the price of tuning against one untuned run, without drawing or training anything.
``--resume`` continues a killed tuning: the same candidates, the finished ones kept, the interrupted one
resumed (every step it started is charged). Exit status as ``sparta-train``'s.
"""

from __future__ import annotations

import sys

from trainers.cli import parse_args, run_command

DESCRIPTION = ("Private hyperparameter tuning: a random number of sparta-train runs of the config (a geometric number "
               "with mean tuning.mean by default; tuning.shape: logarithmic, geometric, poisson or a number >= 0), "
               "each with values drawn from the tuning section's space; the best by noisy validation accuracy is "
               "released in OUTPUT_DIR/release/, and the whole procedure meets privacy.target_epsilon.")
RESUME_HELP = ("continue a killed tuning in output_dir: the same candidates (nothing is drawn again), the finished "
               "ones kept, the interrupted one resumed from its last checkpoint (every step it started is charged)")


def main(argv=None) -> int:
    args = parse_args(argv, prog="sparta-tune", description=DESCRIPTION, resume_help=RESUME_HELP)

    def job(run, config, args):
        from trainers import tune

        return tune.dry_run(config) if args.dry_run else tune.tune(config, resume=args.resume)

    return run_command(args, job, tuning="required")


if __name__ == "__main__":
    sys.exit(main())
