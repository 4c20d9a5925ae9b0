#!/usr/bin/env python
"""Augmentation multiplicity on the zoo: what a K-view DP step costs against the K = 1 step.

Issue 65, item 7: a step with ``augmult = K`` (each example's ``K`` views, its gradient their mean,
clipped once) should take at most ``1.1 K`` times the ``K = 1`` step, ``K`` forward and backward
passes being about ``K`` times one. Measured on the zoo's MLP and ResNet-20-GN
(:mod:`zoo_speed`'s models, batches, DP settings and fit-path steps), every variant built and warmed
up first. The machines are shared and noisy, so the variants are timed in *cycles*, per ``K``: one
cycle runs each variant of that ``K`` (and the ``K = 1`` ones) for two steps and times the second
(the first absorbs the switch), and each ratio is taken within a cycle, then the median over cycles:

  views-1         ``augmult=1`` with the default augmentation (flip + pad-4 crop): one augmented view
                  per example, the reference of every ratio
  views-K         ``augmult=K``: an example's ``K`` view rows are one unit, whose norm is the ghost
                  norm over the unit's positions for linear layers (``sparta_tf.per_example.units``),
                  in the one-pass taps
  views-K-direct  the same step on the path it replaced: every layer's per-row gradients
                  materialised and summed per example, output gradients kept for after the backward
                  pass (:class:`DirectViewsEngine`), to show the gain
  dp-plain        ``augmult=1`` without augmentation (the zoo's ``dp-full``)
  keras-K         the non-private Keras step on ``K B`` rows (``keras-1``: on ``B``): what ``K`` times the
                  rows cost the forward and backward passes alone, the floor of every ratio above 1

Reported per ``K``: the median over cycles of ``step(K) / (K x step(views-1))`` against the 1.1
target, for both paths, the same against the plain step (``dp-plain``), the Keras step's own
``keras-K / (K keras-1)``, each variant's median step, and the engine's norm methods.

    python benchmarks/zoo_views.py                                  # mlp_fused, resnet20_gn; K = 2, 4
    python benchmarks/zoo_views.py --models mlp_fused --views 2 --cycles 5
    python benchmarks/zoo_views.py --smoke                          # tiny shapes, 1 cycle (CI)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import time
from typing import Callable, Dict, List

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# zoo_speed first: it sets the TF environment and puts the repository on the path
from zoo_speed import (  # noqa: E402
    MODELS,
    SMOKE,
    Unavailable,
    ZooModel,
    _commit,
    _machine,
    _ours,
    build_variants,
    make_keras,
)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from sparta_tf.backend import KERAS3  # noqa: E402
from sparta_tf.per_example import BookkeepingEngine  # noqa: E402

TARGET = 1.1  # a K-view step <= 1.1 K x the K = 1 step
DEFAULT_MODELS = ("mlp_fused", "resnet20_gn")
AUGMENTATION = {"flip": True, "pad": 4}  # the default view augmentation, also for the K = 1 reference
DIRECT_BUDGET_GIB = 4.0  # default --direct-budget: views-K-direct's per-example gradients (23 GiB machine)
RESULTS = HERE / "results" / "zoo_views-vm"
RESULTS_KERAS3 = HERE / "results" / "zoo_views-keras3-vm"


class DirectViewsEngine(BookkeepingEngine):
    """The K-view book-keeping step before units (for comparison only): the recording pass keeps
    every layer's output gradient, and every layer's per-row gradients are materialised and summed
    per example (cost table: ``direct_views``), as for layers inside ``TimeDistributed``."""

    def clipped_sum(self, x, y, loss_fn, valid, clip_norm):
        return self.selection_statistic(x, y, loss_fn, valid, clip_norm)

    def _time_distributed(self, layer) -> bool:
        return True


def _use_direct_views(dp) -> None:
    """Builds ``dp``'s engine now and gives it the path before units."""
    dp._engine = dp._make_engine()
    assert isinstance(dp._engine, BookkeepingEngine), type(dp._engine).__name__
    dp._engine.__class__ = DirectViewsEngine


def _direct_views(model, spec: ZooModel, seed: int, views: int, budget_gib: float):
    """``views-K-direct``, skipped where its per-example gradients would exceed ``budget_gib``."""
    sizes = [v.shape.num_elements() for v in model.trainable_variables]
    needed = 4 * spec.batch * (views * max(sizes) + sum(sizes)) / 2**30
    if needed > budget_gib:
        raise Unavailable(f"the path before units would hold {needed:.0f} GiB of per-example gradients (every "
                          f"example's, and one layer's per view row; budget {budget_gib:g} GiB)")
    return _ours(model, spec, seed, configure=_use_direct_views, augmult=views, augmentation=AUGMENTATION)


def variants(views: List[int], direct_budget_gib: float = DIRECT_BUDGET_GIB) -> Dict[str, Callable]:
    """``{name: factory(model, spec, seed) -> (step, dp)}`` of the variants (module doc)."""
    registry: Dict[str, Callable] = {
        "keras-1": make_keras,
        "dp-plain": lambda model, spec, seed: _ours(model, spec, seed),
        "views-1": lambda model, spec, seed: _ours(model, spec, seed, augmult=1, augmentation=AUGMENTATION),
    }
    for k in views:
        registry[f"keras-{k}"] = lambda model, spec, seed, k=k: make_keras(model, _rows(spec, k), seed)
        registry[f"views-{k}"] = lambda model, spec, seed, k=k: _ours(model, spec, seed, augmult=k,
                                                                        augmentation=AUGMENTATION)
        registry[f"views-{k}-direct"] = lambda model, spec, seed, k=k: _direct_views(model, spec, seed, k,
                                                                                    direct_budget_gib)
    return registry


def _rows(spec: ZooModel, views: int) -> ZooModel:
    """``spec`` with ``views`` times its batch."""
    return ZooModel(spec.build, spec.input_shape, spec.batch * views, spec.steps, spec.ids)


def _ratio_terms(k: int) -> list:
    """``[(ratio name, the K-view variant, the K = 1 variant whose K times it is divided by)]``."""
    return [("units", f"views-{k}", "views-1"), ("direct", f"views-{k}-direct", "views-1"),
            ("units_plain", f"views-{k}", "dp-plain"), ("keras", f"keras-{k}", "keras-1")]


def time_cycles(built: Dict[str, Callable], result: dict, views: List[int], cycles: int) -> dict:
    """``{K: {ratio name: median over cycles}}`` (module doc); every timed step also goes to its
    variant's ``times_ms``."""
    out = {}
    for k in views:
        terms = [t for t in _ratio_terms(k) if t[1] in built and t[2] in built]
        order = list(dict.fromkeys(name for _, *names in terms for name in reversed(names)))
        per_cycle: Dict[str, list] = {ratio: [] for ratio, _, _ in terms}
        for cycle in range(cycles):
            times = {}
            for name in order:
                built[name]()  # the switch
                t = time.perf_counter()
                built[name]()
                times[name] = 1000 * (time.perf_counter() - t)
                result["variants"][name]["times_ms"].append(times[name])
            for ratio, name, reference in terms:
                per_cycle[ratio].append(times[name] / (k * times[reference]))
            print(f"  K={k} cycle {cycle + 1}/{cycles} done", flush=True)
        out[str(k)] = {ratio: (float(np.median(values)) if values else None) for ratio, values in per_cycle.items()}
        for ratio, _, _ in _ratio_terms(k):
            out[str(k)].setdefault(ratio, None)
        out[str(k)]["per_cycle"] = per_cycle
    for entry in result["variants"].values():
        if entry.get("times_ms"):
            entry["median_ms"] = float(np.median(entry["times_ms"]))
    return out


def markdown(results: List[dict], machine: str) -> str:
    lines = [
        f"A K-view DP step (augmentation multiplicity) against the K = 1 step, {machine}, one process, "
        "timed in cycles (each ratio within a cycle, then the median over cycles; steps: medians). `views-1`: one augmented view per example (flip + pad-4 crop); "
        f"ratio: step(K) / (K x step(views-1)), target <= {TARGET:g}. `units`: today's step (an example's "
        "views one unit, ghost norms over the unit's positions, one-pass taps); `direct`: the path it "
        "replaced (every layer's per-row gradients materialised and summed per example); in brackets the "
        "quartiles of the ratio over the cycles. `ratio to plain`: "
        "step(K) / (K x the plain DP step, no augmentation). `Keras`: the non-private step on K B rows over "
        "K times the step on B rows, what the forward and backward passes alone cost beyond K.",
        "",
        "| model | B | plain DP step | views-1 | K | views-K (units) | ratio (units) | views-K (direct) | "
        "ratio (direct) | target | ratio to plain (units) | Keras K B rows / K x B rows | norm methods (units) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in results:
        v = r["variants"]

        def ms(name):
            value = v.get(name, {}).get("median_ms")
            return "-" if value is None else f"{value:.0f} ms"

        for k, ratio in r["ratios"].items():
            units, direct = ratio["units"], ratio["direct"]
            verdict = "-" if units is None else ("met" if units <= TARGET else f"NOT met (+{units / TARGET - 1:.0%})")
            methods = ", ".join(f"{m} {n}" for m, n in v.get(f"views-{k}", {}).get("norm_methods", {}).items())
            spread = _quartiles(ratio.get("per_cycle", {}))
            lines.append(f"| {r['model']} ({r.get('commit', '')}) | {r['batch_size']} | {ms('dp-plain')} | "
                         f"{ms('views-1')} | {k} | {ms(f'views-{k}')} | {_ratio(units)}{spread('units')} | "
                         f"{ms(f'views-{k}-direct')} | {_ratio(direct)}{spread('direct')} | {verdict} | "
                         f"{_ratio(ratio.get('units_plain'))} | {_ratio(ratio.get('keras'))} | {methods} |")
    skipped = [f"{r['model']} {name}: {entry['note']}" for r in results for name, entry in r["variants"].items()
               if entry.get("status") in ("skipped", "error")]
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _quartiles(per_cycle: dict) -> Callable[[str], str]:
    """``name -> " (q1-q3)"``: the spread of a ratio over the cycles ("" where none was recorded)."""
    def spread(name: str) -> str:
        values = per_cycle.get(name)
        if not values:
            return ""
        q1, q3 = np.percentile(values, [25, 75])
        return f" ({q1:.2f}-{q3:.2f})"
    return spread


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS))
    parser.add_argument("--views", nargs="+", type=int, default=[2, 4], help="the K > 1 to measure")
    parser.add_argument("--cycles", type=int, default=10, help="timed cycles per K (module doc)")
    parser.add_argument("--variants", nargs="+", help="only these (default: every one of the --views)")
    parser.add_argument("--direct-budget", type=float, default=DIRECT_BUDGET_GIB,
                        help="GiB of per-example gradients the path before units may hold (else skipped)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_KERAS3 if KERAS3 else RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 cycle (CI); writes nothing")
    parser.add_argument("--table-only", action="store_true", help="only rewrite the .md from the JSON")
    args = parser.parse_args(argv)
    if args.table_only:
        payload = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(payload["results"], payload["machine"]))
        return 0
    registry = variants(args.views, args.direct_budget)
    names = [n for n in registry if args.variants is None or n in args.variants]
    zoo = {"mlp_fused": SMOKE["mlp_fused"]} if args.smoke else {name: MODELS[name] for name in args.models}
    results = []
    for name, spec in zoo.items():
        print(f"{name} (B={spec.batch})", flush=True)
        result = {"model": name, "batch_size": spec.batch, "commit": _commit(), "variants": {}}
        built = build_variants(name, spec, names, args.seed, result, registry)
        result["ratios"] = time_cycles(built, result, args.views, 1 if args.smoke else args.cycles)
        built.clear()
        tf.keras.backend.clear_session()
        gc.collect()
        results.append(result)
        for k, ratio in result["ratios"].items():
            print(f"  K={k}: step(K) / (K step(1)) = {_ratio(ratio['units'])} (direct: {_ratio(ratio['direct'])}; "
                  f"to the plain step: {_ratio(ratio['units_plain'])}; Keras: {_ratio(ratio['keras'])}); "
                  f"target <= {TARGET:g}", flush=True)
        if not args.smoke:  # after every model: a run killed later keeps what it measured
            _write(args.out, results, args.views)
    return 0


def _write(out: pathlib.Path, results: List[dict], views: List[int]) -> None:
    machine = f"{_machine()}, this process on {len(os.sched_getaffinity(0))} of them"
    payload = {"machine": machine, "views": views, "target": TARGET, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(markdown(results, machine))


if __name__ == "__main__":
    sys.exit(main())
