#!/usr/bin/env python
"""How far the white-box audit's one-run bound can go: the bound of the exact mechanism, simulated.

For the white-box table's regime (``benchmarks/audit.py --white-box``: the quickstart task, expected
batch 16, 20 epochs, delta 1e-5; its honest cells give each claim's sigma, the rate q and the steps T),
:func:`sparta_tf.audit.power.simulated_bound` audits the mechanism itself, with no training in the way,
for ``m`` canaries from 500 to 50,000: honest at every claimed epsilon, and, claiming epsilon 1, the
noise at half its sigma and the sampler at twice its rate. Each number is the mean (lowest-highest)
bound of ``--trials`` simulated audits (default 20, as in the committed results) at ``--confidence``
per score (default: the level of each bound of a white-box audit at sparta-audit's 95%,
:func:`sparta_tf.audit.white_box.verdict_levels`; the committed results are at ``--confidence 0.975``). It
shows whether a measured bound is what an honest run gives, and how many canaries a factor-two error
would need to push the bound over the claim.

    python benchmarks/audit_power.py            # ~17 min on one core; benchmarks/results/audit-power.{json,md}
    python benchmarks/audit_power.py --smoke --out /tmp/audit-power   # CI, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sparta_tf.atomic_files import write_atomic  # noqa: E402
from sparta_tf.audit.power import simulated_bound  # noqa: E402
from sparta_tf.audit.white_box import verdict_levels  # noqa: E402

REGIME = os.path.join(ROOT, "benchmarks", "results", "audit-digits-white-box.json")
OUT = os.path.join(ROOT, "benchmarks", "results", "audit-power")
CANARIES = (500, 1000, 2000, 5000, 10000, 20000, 50000)
CONFIDENCE = verdict_levels(0.95).bound  # each white-box bound's level in sparta-audit's 95% verdict
TRIALS = 20  # the committed results' (benchmarks/results/audit-power.json)


def mechanisms(regime_path: str) -> list[dict]:
    """The honest mechanism of each claim in the white-box table, then the two broken ones claiming 1."""
    with open(regime_path) as f:
        cells = json.load(f)
    honest = sorted((r for r in cells.values() if r["setting"][0].isdigit() and r["method"] == "all"),
                    key=lambda r: r["claimed_epsilon"])
    rows = [{"mechanism": "honest", "claimed": r["claimed_epsilon"], "sigma": r["noise_multiplier"],
             "q": r["sample_rate"], "steps": r["observed_steps"]} for r in honest]
    one = next(r for r in rows if abs(r["claimed"] - 1.0) < 0.01)
    rows.append(one | {"mechanism": "half noise", "sigma": one["sigma"] / 2})
    rows.append(one | {"mechanism": "double rate", "q": 2 * one["q"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=TRIALS, help=f"simulated audits per cell (default {TRIALS})")
    parser.add_argument("--confidence", type=float, default=CONFIDENCE,
                        help=f"confidence per score (default {CONFIDENCE:.4g}: a white-box bound's in a 95%% verdict)")
    parser.add_argument("--out", default=OUT, help="stem of the .json / .md outputs")
    parser.add_argument("--smoke", action="store_true", help="m = 500 and 1000, one trial (CI)")
    args = parser.parse_args(argv)
    counts, trials = ((500, 1000), 1) if args.smoke else (CANARIES, args.trials)
    rows = mechanisms(REGIME)
    start = time.time()
    for row in rows:
        row["bounds"] = {m: simulated_bound(row["sigma"], row["q"], row["steps"], m, 1e-5, trials=trials,
                                            confidence=args.confidence).__dict__ for m in counts}
        print(row["mechanism"], row["claimed"], {m: round(b["mean"], 2) for m, b in row["bounds"].items()}, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_atomic(args.out + ".json", json.dumps({"trials": trials, "confidence": args.confidence, "rows": rows},
                                                indent=1))
    lines = ["| mechanism | ε claimed | σ | q | steps | " + " | ".join(f"m = {m:,}" for m in counts) + " |",
             "|" + "---|" * (5 + len(counts))]
    for row in rows:
        cells = [f"{b['mean']:.2f} ({b['low']:.2f}-{b['high']:.2f})" for b in row["bounds"].values()]
        lines.append(f"| {row['mechanism']} | {row['claimed']:.2f} | {row['sigma']:.3g} | {row['q']:.4g} "
                     f"| {row['steps']} | " + " | ".join(cells) + " |")
    lines += ["", f"Mean (lowest-highest) of {trials} simulated audits per cell, at {args.confidence:.1%} confidence "
              f"per score; {time.time() - start:.0f} s."]
    write_atomic(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
