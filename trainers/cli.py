"""``sparta-train --config configs/NAME.yaml [--set section.key=value ...] [--dry-run] [--resume]``.

The config is validated before TensorFlow is imported: a malformed config
exits with status 2 and one line naming the key and the fix. ``--dry-run``
loads the data and builds the model, then prints the plan (n, q, steps,
calibrated sigma, epsilon at the end of each phase, trainable parameters per
phase) without training. ``--resume`` continues an interrupted run from its
last complete checkpoint in ``output_dir``. Ctrl-C stops a run with one line
saying how to resume it (exit status 130).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from trainers.config import ConfigError, load_config
from trainers.interrupt import stop_on_ctrl_c
from trainers.quiet import import_tensorflow


def parse_args(argv=None, prog: str = "sparta-train", description: str | None = None,
               resume_help: str = "continue from the last checkpoint in output_dir") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set privacy.target_epsilon=2")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit without training")
    parser.add_argument("--resume", action="store_true", help=resume_help)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return run_command(parse_args(argv), lambda run, config, args: run.dry_run(config) if args.dry_run
                       else run.train(config, resume=args.resume), tuning="ignored")


def run_command(args: argparse.Namespace, job, tuning: str) -> int:
    """Loads the config, imports TensorFlow and runs ``job(trainers.run, config, args)``, turning every
    user error into one line and an exit status (2: config, 1: run, 130: Ctrl-C). ``tuning``: what a
    ``tuning`` section means to the command ("ignored": a note; "required": a config error without it)."""
    try:
        config = load_config(args.config, args.overrides)
        if tuning == "required" and "tuning" not in config:
            raise ConfigError("the config has no tuning section: add one (tuning: {space: {training.learning_rate: "
                              "[0.03, 0.1, 0.3]}, mean: 5}), or run sparta-train for one run")
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    notes = list(config["notes"])
    if tuning == "ignored" and "tuning" in config:
        notes.append("the tuning section is sparta-tune's: sparta-train runs the config's own values once")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return stop_on_ctrl_c(lambda: _run_job(job, config, args),
                          lambda: interrupted_line(config["output_dir"], args.dry_run))


def _run_job(job, config: dict, args: argparse.Namespace) -> int:
    """Imports TensorFlow and runs ``job``; see :func:`run_command`."""
    import_tensorflow()
    from trainers import run  # heavy: imports TensorFlow

    try:
        job(run, config, args)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except run.USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the disk, not the config: a full disk, a vanished file, an I/O error
        where = f" writing {error.filename}" if getattr(error, "filename", None) else ""
        fix = ("free disk space, then run again with --resume" if error.errno == errno.ENOSPC
               else "fix the file system problem, then run again with --resume")
        print(f"error: {error.strerror or error}{where}; {fix}", file=sys.stderr)
        return 1
    return 0


def interrupted_line(output_dir: str, dry_run: bool) -> str:
    """The one line Ctrl-C prints (:mod:`trainers.interrupt`): what stopped and how to continue."""
    if dry_run:
        return "interrupted: the dry run stopped (Ctrl-C); it wrote nothing"
    return (f"interrupted: the run in {output_dir} stopped (Ctrl-C); every step it started is charged to its "
            "ledger; continue it with the same command plus --resume")


if __name__ == "__main__":
    sys.exit(main())
