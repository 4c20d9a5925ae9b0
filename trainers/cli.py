"""``sparta-train``: the config-driven trainer (the name is reserved in pyproject).

The YAML-driven CLI is the next milestone; until it lands this entry point
says so instead of failing with an import error.
"""

import sys


def main(argv=None) -> int:
    print(
        "sparta-train: the config-driven trainer is not available in this version; "
        "run `sparta-example` (python -m sparta_tf.examples.quickstart) or use sparta_tf.DPModel",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
