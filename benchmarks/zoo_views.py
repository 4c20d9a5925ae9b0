#!/usr/bin/env python
"""Augmentation multiplicity on the zoo: what a K-view DP step costs against the K = 1 step.

Issue 65, item 7: a step with ``augmult = K`` (each example's ``K`` views, its gradient their mean,
clipped once) should take at most ``1.1 K`` times the ``K = 1`` step, ``K`` forward and backward
passes being about ``K`` times one. Measured on the zoo's MLP and ResNet-20-GN
(:mod:`zoo_speed`'s models, batches, DP settings and fit-path timing: every variant built and
warmed up, then timed in interleaved rounds, rotated order, an untimed re-entry step per block;
medians):

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

Reported per ``K``: ``median step(K) / (K x median step(views-1))`` against the 1.1 target, for both
paths, the same against the plain step (``dp-plain``), the Keras step's own ``keras-K / (K keras-1)``,
and the engine's norm methods.

    python benchmarks/zoo_views.py                                  # mlp_fused, resnet20_gn; K = 2, 4
    python benchmarks/zoo_views.py --models mlp_fused --views 2 --rounds 3
    python benchmarks/zoo_views.py --smoke                          # tiny shapes, 1 round (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Callable, Dict, List

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# zoo_speed first: it sets the TF environment and puts the repository on the path
from zoo_speed import MODELS, SMOKE, Unavailable, ZooModel, _machine, _ours, make_keras, time_model  # noqa: E402

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


def ratios(result: dict, views: List[int]) -> dict:
    """Per ``K``: ``units`` = step(K) / (K step(views-1)), ``direct`` the same on the path before,
    ``units_plain`` = step(K) / (K step(dp-plain)), ``keras`` = keras-K / (K keras-1) (None where a
    variant did not run)."""
    measured = {name: entry.get("median_ms") for name, entry in result["variants"].items()}

    def ratio(name, reference, k):
        return measured[name] / (k * measured[reference]) if measured.get(reference) and measured.get(name) else None

    return {str(k): {"units": ratio(f"views-{k}", "views-1", k), "direct": ratio(f"views-{k}-direct", "views-1", k),
                     "units_plain": ratio(f"views-{k}", "dp-plain", k), "keras": ratio(f"keras-{k}", "keras-1", k)}
            for k in views}


def markdown(results: List[dict], machine: str) -> str:
    lines = [
        f"A K-view DP step (augmentation multiplicity) against the K = 1 step, {machine}, one process, "
        "variants interleaved (medians). `views-1`: one augmented view per example (flip + pad-4 crop); "
        f"ratio: step(K) / (K x step(views-1)), target <= {TARGET:g}. `units`: today's step (an example's "
        "views one unit, ghost norms over the unit's positions, one-pass taps); `direct`: the path it "
        "replaced (every layer's per-row gradients materialised and summed per example). `ratio to plain`: "
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
            lines.append(f"| {r['model']} ({r.get('commit', '')}) | {r['batch_size']} | {ms('dp-plain')} | "
                         f"{ms('views-1')} | {k} | {ms(f'views-{k}')} | {_ratio(units)} | "
                         f"{ms(f'views-{k}-direct')} | {_ratio(direct)} | {verdict} | "
                         f"{_ratio(ratio.get('units_plain'))} | {_ratio(ratio.get('keras'))} | {methods} |")
    return "\n".join(lines) + "\n"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS))
    parser.add_argument("--views", nargs="+", type=int, default=[2, 4], help="the K > 1 to measure")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default: the zoo's)")
    parser.add_argument("--variants", nargs="+", help="only these (default: every one of the --views)")
    parser.add_argument("--direct-budget", type=float, default=DIRECT_BUDGET_GIB,
                        help="GiB of per-example gradients the path before units may hold (else skipped)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_KERAS3 if KERAS3 else RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 round (CI); writes nothing")
    args = parser.parse_args(argv)
    registry = variants(args.views, args.direct_budget)
    names = [n for n in registry if args.variants is None or n in args.variants]
    zoo = {"mlp_fused": SMOKE["mlp_fused"]} if args.smoke else {name: MODELS[name] for name in args.models}
    results = []
    for name, spec in zoo.items():
        if args.steps is not None:
            spec = ZooModel(spec.build, spec.input_shape, spec.batch, args.steps, spec.ids)
        print(f"{name} (B={spec.batch})", flush=True)
        result = time_model(name, spec, names, 1 if args.smoke else args.rounds, args.seed, registry)
        result["ratios"] = ratios(result, args.views)
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
