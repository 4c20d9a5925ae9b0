"""Saving and loading masks (the kernel part of a trainable set).

A mask directory holds

* ``mask.npz`` -- for every masked kernel, its kept row indices
  (``<variable>::rows``) or flat entry indices (``<variable>::entries``), plus
  ``__meta__`` (a JSON string: method, score, density, granularity, private);
* ``mask.json`` -- the same meta data and rows/entries kept per layer;
* ``mask.md`` -- a Markdown table of the kept rows per layer, for humans.

Files are written to a temporary name and renamed, so a crash never leaves
a half-written mask behind. The mask is a DP output (or public, for MP and
random), so it can be shared; ``private: false`` marks an oracle mask.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import trainable
from sparta_tf.groups import parameter_table
from sparta_tf.trainable import VariableSelection

MASK_FILE = "mask.npz"
SUMMARY_FILE = "mask.json"
TABLE_FILE = "mask.md"
_META_KEY = "__meta__"


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def mask_summary(selections: Sequence[VariableSelection], model: tf.keras.Model) -> list[dict[str, Any]]:
    """Per maskable kernel: layer, variable, kept and total rows (or entries)."""
    chosen = {id(s.variable): s for s in selections}
    rows = []
    for info in parameter_table(model):
        if info.group is None:
            continue
        sel = chosen.get(id(info.variable))
        if sel is None:
            kept, total, unit = 0, info.group.n_rows, "rows"
        elif sel.kind == "entries":
            kept, total, unit = sel.size, info.size, "entries"
        else:
            kept = info.group.n_rows if sel.kind == "dense" else len(sel.rows)
            total, unit = info.group.n_rows, "rows"
        rows.append({"layer": info.layer, "variable": info.variable.name, "unit": unit,
                     "kept": int(kept), "total": int(total), "fraction": kept / total})
    return rows


def _markdown(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    header = ", ".join(f"{k}={v}" for k, v in meta.items())
    lines = [f"# Mask ({header})", "", "| layer | variable | kept | total | fraction |", "|---|---|---:|---:|---:|"]
    for r in summary:
        lines.append(f"| {r['layer']} | {r['variable']} | {r['kept']} {r['unit']} | {r['total']} | {r['fraction']:.1%} |")
    return "\n".join(lines) + "\n"


def save_mask(directory: str, selections: Sequence[VariableSelection], model: tf.keras.Model, **meta) -> str:
    """Writes ``mask.npz``, ``mask.json``, ``mask.md`` into ``directory``; returns the npz path."""
    names = [sel.variable.name for sel in selections]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"variables {duplicates} share a name, so a saved mask could not tell them apart; "
                         "give the layers unique names")
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    for sel in selections:
        if sel.kind == "rows":
            arrays[f"{sel.variable.name}::rows"] = sel.rows
        elif sel.kind == "entries":
            arrays[f"{sel.variable.name}::entries"] = sel.entries
        else:
            arrays[f"{sel.variable.name}::dense"] = np.zeros(0, np.int64)
    arrays[_META_KEY] = np.array(json.dumps(meta))
    summary = mask_summary(selections, model)
    npz_path = os.path.join(directory, MASK_FILE)

    def write_npz(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    def write_text(text):
        def write(tmp):
            with open(tmp, "w") as f:
                f.write(text)
        return write

    _atomic_write(npz_path, write_npz)
    _atomic_write(os.path.join(directory, SUMMARY_FILE),
                  write_text(json.dumps({"meta": meta, "layers": summary}, indent=2) + "\n"))
    _atomic_write(os.path.join(directory, TABLE_FILE), write_text(_markdown(summary, meta)))
    return npz_path


def load_mask(path: str, model: tf.keras.Model) -> tuple[list[VariableSelection], dict[str, Any]]:
    """``(selections, meta)`` from a mask directory or ``mask.npz`` for ``model``."""
    if os.path.isdir(path):
        path = os.path.join(path, MASK_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no mask at {path}: run a selection epoch first or fix the path")
    by_name = {info.variable.name: info for info in parameter_table(model)}
    selections = []
    with np.load(path) as data:
        meta = json.loads(str(data[_META_KEY])) if _META_KEY in data else {}
        for key in data.files:
            if key == _META_KEY:
                continue
            name, _, kind = key.rpartition("::")
            info = by_name.get(name)
            if info is None:
                raise ValueError(f"mask {path} names variable {name!r}, which this model does not have; "
                                 "load the mask into the model it was selected for")
            values = data[key]
            if kind == "rows":
                selections.append(trainable.rows(info.group, values))
            elif kind == "entries":
                mask = np.zeros(info.size, dtype=bool)
                mask[values] = True
                selections.append(trainable.entries(info.variable, mask.reshape(info.variable.shape)))
            else:
                selections.append(trainable.dense(info.variable))
    return [s for s in selections if s is not None], meta
