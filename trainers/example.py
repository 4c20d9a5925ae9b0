"""``sparta-example``: the bundled quickstart task from the command line (:mod:`sparta_tf.examples.quickstart`).

Public pre-training on the digits 0-4, then DP fine-tuning of a fresh head and
backbone on the private digits 5-9 by any method of the registry, through
:func:`sparta_tf.make_private`, at ``--epsilon``. The arguments are checked
before TensorFlow is imported: a bad one is one line (argparse's), and so are a
method that cannot run with the given epochs and Ctrl-C (exit status 130).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from trainers import config
from trainers.interrupt import stop_on_ctrl_c
from trainers.quiet import import_tensorflow

DESCRIPTION = "Quickstart: public pre-training, then DP fine-tuning with a calibrated (epsilon, delta)."


METHOD_NAMES = config.METHOD_NAMES
"""Every method, from the TensorFlow-free spec :mod:`sparta_tf.method_spec` (``--help`` imports no TensorFlow)."""


def _number(low: float, high: float, *, low_open: bool = True, high_open: bool = False, kind=float,
            interval: str | None = None):
    """An argparse type: a finite ``kind`` in the interval from ``low`` to ``high`` (open or closed ends)."""
    interval = interval or f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"{text} must be {interval}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparta-example", description=DESCRIPTION)
    positive = _number(0, math.inf, high_open=True, interval="> 0")
    parser.add_argument("--epsilon", type=positive, default=4.0,
                        help="target epsilon of the whole run, > 0 (default 4)")
    parser.add_argument("--delta", type=_number(0, 1, high_open=True, interval="in (0, 1)"), default=1e-5, help="delta in (0, 1)")
    count = _number(1, math.inf, low_open=False, kind=int, interval="an integer >= 1")
    parser.add_argument("--epochs", type=count, default=15,
                        help="DP fine-tuning epochs (sparta and its kin need at least 3)")
    parser.add_argument("--pretrain-epochs", type=count, default=15,
                        help="non-private pre-training epochs on the public digits")
    parser.add_argument("--sample-rate", type=_number(0, 1, interval="in (0, 1]"), default=0.1,
                        help="Poisson rate q in (0, 1]")
    parser.add_argument("--method", default="sparta", choices=METHOD_NAMES, metavar="METHOD",
                        help=f"one of {', '.join(METHOD_NAMES)} (default sparta; docs/methods.md)")
    parser.add_argument("--lr", type=positive, default=0.05,
                        help="learning rate of the backbone")
    parser.add_argument("--head-lr", type=positive, default=0.5,
                        help="learning rate of the fresh head (paper: 10x)")
    parser.add_argument("--density", type=_number(0, 1, interval="in (0, 1]"), default=0.2,
                        help="fraction of rows kept per layer, in (0, 1] (sparta, dpsgd_grad, oracle, mp, random)")
    parser.add_argument("--seed", type=_number(0, 2**63, low_open=False, high_open=True, kind=int,
                                               interval="an integer in [0, 2**63)"), default=None,
                        help="seed for reproducible runs (default: secret)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Runs the example; a bad argument is one line (argparse's), and so are a method that cannot run and
    Ctrl-C (exit status 130, :mod:`trainers.interrupt`)."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's C++ start-up lines off unless the user set a level
    return stop_on_ctrl_c(lambda: _run(args), lambda: INTERRUPTED_LINE)


INTERRUPTED_LINE = ("interrupted: sparta-example stopped (Ctrl-C); it keeps its models in memory and wrote nothing, "
                    "so it cannot be resumed: run the same command again to start over")
"""What Ctrl-C prints: the example has no run directory (``make_private`` without ``run_dir``)."""


def _run(args: argparse.Namespace) -> int:
    import_tensorflow()  # TensorFlow only now, after the arguments
    from sparta_tf.examples.quickstart import run

    try:
        run(args)
    except ValueError as error:
        print(f"sparta-example: error: {str(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
