"""Saving and loading masks (the kernel part of a trainable set).

A mask directory holds

* ``mask.npz`` -- for every masked kernel, its kept row indices
  (``<variable>::rows``) or flat entry indices (``<variable>::entries``), plus
  ``__meta__`` (a JSON string: method, score, density, granularity, the
  privacy provenance and the model it belongs to);
* ``mask.json`` -- the same meta data and rows/entries kept per layer;
* ``mask.md`` -- a Markdown table of the kept rows per layer, for humans.

Files are written to a temporary name and renamed, so a crash never leaves
a half-written mask behind.

**Provenance.** A mask is an output of whatever chose it, so using it in
another run composes with that choice. ``meta["privacy"]`` records it
(:class:`MaskProvenance`): ``private`` (False for an oracle mask, chosen from
exact gradients), the reasons it is not, and the ledger entries spent up to
the moment it was chosen (SPARTA: the warm-up and the selection epoch; MP
and random masks: none, they look at no private data). A run that loads a
mask charges those entries to its own ledger and is marked non-private when
the mask is (:meth:`MaskProvenance.charge`), assuming the worst case that
the mask was chosen on the same private data. A mask without provenance
(made by hand, or by sparta-tf before it recorded one) cannot be accounted
for and marks the run non-private; re-save it with
``save_mask(..., provenance=MaskProvenance.public())`` if it was chosen from
public information only.

**Model.** ``meta["model"]`` lists the shape of every maskable kernel; a mask
loads only into a model whose maskable kernels have the same names and
shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import trainable
from sparta_tf.backend import KERAS3, variable_key
from sparta_tf.atomic_files import replace_atomically, write_atomic
from sparta_tf.groups import parameter_table, row_groups
from sparta_tf.privacy.ledger import LedgerEntry, check_unit
from sparta_tf.trainable import VariableSelection

MASK_FILE = "mask.npz"
SUMMARY_FILE = "mask.json"
TABLE_FILE = "mask.md"
_META_KEY = "__meta__"


MASK_CHARGE_PREFIX = "mask:"
"""The phase prefix of the ledger entries that charge a loaded mask's cost (not this run's steps)."""


def is_mask_charge(entry: LedgerEntry) -> bool:
    """True for a ledger entry that charges a loaded mask's cost (:meth:`MaskProvenance.charge`)."""
    return (entry.phase or "").startswith(MASK_CHARGE_PREFIX)


@dataclasses.dataclass(frozen=True)
class MaskProvenance:
    """How a mask was chosen, for the privacy ledger of a run that uses it (see the module doc)."""

    private: bool
    entries: tuple[LedgerEntry, ...] = ()
    reasons: tuple[str, ...] = ()
    caveats: tuple[str, ...] = ()
    unit: str = "example"
    """What the entries' neighbouring datasets differ by (the choosing run's ledger's unit)."""

    @classmethod
    def public(cls) -> "MaskProvenance":
        """A mask that looked at no private data (MP, random, hand-made from public knowledge)."""
        return cls(private=True)

    @classmethod
    def of_ledger(cls, ledger) -> "MaskProvenance":
        """The provenance of a mask chosen now, by a run whose ledger is ``ledger``."""
        return cls(private=ledger.is_private, entries=tuple(ledger.entries), reasons=ledger.nonprivate_reasons,
                   caveats=tuple(ledger.caveats()), unit=ledger.unit)

    def to_json(self) -> dict[str, Any]:
        return {"private": self.private, "entries": [e.to_dict() for e in self.entries],
                "nonprivate_reasons": list(self.reasons), "caveats": list(self.caveats), "unit": self.unit}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], path: str) -> "MaskProvenance":
        privacy = meta.get("privacy")
        if not isinstance(privacy, dict) or "private" not in privacy:
            return cls(private=False, reasons=(
                f"mask {path} records no privacy provenance (made by hand or by an older sparta-tf), so what "
                "chose it cannot be accounted for",))
        try:
            entries = tuple(LedgerEntry.from_dict(e) for e in privacy.get("entries", []))
            reasons = tuple(str(r) for r in privacy.get("nonprivate_reasons", []))
            caveats = tuple(str(c) for c in privacy.get("caveats", []))
            unit = check_unit(privacy.get("unit", "example"))  # masks saved before units were recorded: examples
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"mask {path} has a damaged privacy record ({error}); re-create the mask") from None
        if not privacy["private"] and not reasons:
            reasons = (f"mask {path} was chosen without differential privacy (method {meta.get('method')})",)
        return cls(bool(privacy["private"]) and not reasons, entries, reasons, caveats, unit)

    def charged_entries(self) -> list[LedgerEntry]:
        """What choosing the mask spent, as a run that loads it records it: phase ``mask:<its phase>``."""
        return [dataclasses.replace(entry, phase=f"{MASK_CHARGE_PREFIX}{entry.phase}") for entry in self.entries]

    def charge(self, ledger, source: str) -> None:
        """Records :meth:`charged_entries` in ``ledger``; marks it non-private if the mask is not, and
        carries over its caveats (e.g. shuffled batches, which the accountant does not cover)."""
        if self.entries and self.unit != ledger.unit:  # check_unit_of_method refused it before the run
            raise ValueError(f"the mask loaded from {source} was chosen at unit {self.unit!r}, this run's ledger "
                             f"protects one {ledger.unit}; choose the mask again at this run's unit")
        for entry in self.charged_entries():
            ledger.charge(entry)  # bands kept: a mask chosen under BandMF costs its reduction
        for reason in self.reasons:
            ledger.record_nonprivate(f"{reason} (loaded from {source})")
        for caveat in self.caveats:
            ledger.record_caveat(f"the mask loaded from {source}: {caveat}")


def model_fingerprint(model: tf.keras.Model) -> dict[str, list[int]]:
    """``{kernel variable name: shape}`` of every maskable kernel: what a mask must match."""
    return {variable_key(g.variable): g.variable.shape.as_list() for g in row_groups(model)}


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
        rows.append({"layer": info.layer, "variable": variable_key(info.variable), "unit": unit,
                     "kept": int(kept), "total": int(total), "fraction": kept / total})
    return rows


def _markdown(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    header = ", ".join(f"{k}={v}" for k, v in meta.items() if k not in ("privacy", "model"))
    header += f", private={meta['privacy']['private']}"
    lines = [f"# Mask ({header})", "", "| layer | variable | kept | total | fraction |", "|---|---|---:|---:|---:|"]
    for r in summary:
        lines.append(f"| {r['layer']} | {r['variable']} | {r['kept']} {r['unit']} | {r['total']} | {r['fraction']:.1%} |")
    return "\n".join(lines) + "\n"


def save_mask(directory: str, selections: Sequence[VariableSelection], model: tf.keras.Model, *,
              provenance: MaskProvenance, **meta) -> str:
    """Writes ``mask.npz``, ``mask.json``, ``mask.md`` into ``directory``; returns the npz path.

    ``provenance``: how the mask was chosen (:class:`MaskProvenance`); ``meta``:
    free labels (method, score, density, granularity).
    """
    meta = dict(meta, privacy=provenance.to_json(), model=model_fingerprint(model))
    names = [variable_key(sel.variable) for sel in selections]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"variables {duplicates} share a name, so a saved mask could not tell them apart; "
                         "give the layers unique names")
    arrays = {}
    for sel in selections:
        if sel.kind == "rows":
            arrays[f"{variable_key(sel.variable)}::rows"] = sel.rows
        elif sel.kind == "entries":
            arrays[f"{variable_key(sel.variable)}::entries"] = sel.entries
        else:
            arrays[f"{variable_key(sel.variable)}::dense"] = np.zeros(0, np.int64)
    arrays[_META_KEY] = np.array(json.dumps(meta))
    summary = mask_summary(selections, model)
    npz_path = os.path.join(directory, MASK_FILE)

    def write_npz(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    replace_atomically(npz_path, write_npz)
    write_atomic(os.path.join(directory, SUMMARY_FILE), json.dumps({"meta": meta, "layers": summary}, indent=2) + "\n")
    write_atomic(os.path.join(directory, TABLE_FILE), _markdown(summary, meta))
    return npz_path


def selections_digest(selections: Sequence[VariableSelection] | None) -> str | None:
    """A digest of the coordinates ``selections`` keep (each variable's key, kind and indices, in order);
    None for no mask. A checkpoint records the mask its run trained with, so that a resumed run
    cannot train another one (loaded from another file, or a file replaced since) that its ledger never
    charged."""
    if selections is None:
        return None
    digest = hashlib.sha256()
    for selection in sorted(selections, key=lambda s: (variable_key(s.variable), s.kind)):
        indices = selection.rows if selection.kind == "rows" else selection.entries
        digest.update(f"{variable_key(selection.variable)}::{selection.kind}:".encode())
        if indices is not None:
            digest.update(np.asarray(indices, np.int64).tobytes())
        digest.update(b";")
    return digest.hexdigest()


def has_mask(directory: str | None) -> bool:
    """True when ``directory`` holds a saved mask."""
    return directory is not None and os.path.exists(os.path.join(directory, MASK_FILE))


def mask_file(path: str) -> str:
    """``path`` itself, or ``path/mask.npz`` for a mask directory; FileNotFoundError if absent."""
    if os.path.isdir(path):
        path = os.path.join(path, MASK_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no mask at {path}: run a selection epoch first or fix the path")
    return path


def _read(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, meta)`` of the mask file at ``path``; a ValueError for anything that is not one."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(str(arrays.pop(_META_KEY))) if _META_KEY in arrays else {}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{path} is not a mask saved by sparta-tf ({first}); point to a mask directory "
                         "written by a selection epoch or save_mask") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a mask saved by sparta-tf (its metadata is not a mapping)")
    return arrays, meta


def read_provenance(path: str) -> MaskProvenance:
    """The provenance recorded with the mask at ``path`` (a directory or ``mask.npz``)."""
    path = mask_file(path)
    return MaskProvenance.from_meta(_read(path)[1], path)


def load_mask(path: str, model: tf.keras.Model) -> tuple[list[VariableSelection], dict[str, Any]]:
    """``(selections, meta)`` from a mask directory or ``mask.npz`` for ``model``.

    ``MaskProvenance.from_meta(meta, path)`` says what using it costs. A mask
    recorded for a model with other maskable kernels is refused.
    """
    path = mask_file(path)
    by_name = {variable_key(info.variable): info for info in parameter_table(model)}
    arrays, meta = _read(path)
    _check_model(meta, model, path)
    selections = []
    for key, values in arrays.items():
        name, _, kind = key.rpartition("::")
        info = by_name.get(name)
        if info is None:
            raise ValueError(f"mask {path} names variable {name!r}, which this model does not have; "
                             "load the mask into the model it was selected for")
        selections.append(_selection(info, kind, values, path))
    return [s for s in selections if s is not None], meta


def _selection(info, kind: str, values: np.ndarray, path: str):
    """The selection stored under ``<variable>::<kind>``, checked against the variable."""
    if kind == "rows":
        if info.group is None or values.size and (values.min() < 0 or values.max() >= info.group.n_rows):
            raise ValueError(f"mask {path}: rows of {variable_key(info.variable)} do not fit this model")
        return trainable.rows(info.group, values)
    if kind == "entries":
        if values.size and (values.min() < 0 or values.max() >= info.size):
            raise ValueError(f"mask {path}: entries of {variable_key(info.variable)} do not fit this model")
        mask = np.zeros(info.size, dtype=bool)
        mask[values] = True
        return trainable.entries(info.variable, mask.reshape(info.variable.shape))
    if kind == "dense":
        return trainable.dense(info.variable)
    raise ValueError(f"mask {path}: unknown selection kind {kind!r} for {variable_key(info.variable)}")


def _renamed_model(recorded: dict[str, Any], ours: dict[str, Any]) -> tuple[str, str] | None:
    """``(recorded name, our name)`` when two fingerprints differ only in their variables' first path
    component, the same one in each (the model's name), else None."""
    def split(fingerprint):
        prefixes = {key.partition("/")[0] for key in fingerprint}
        rest = {key.partition("/")[2]: shape for key, shape in fingerprint.items()}
        return prefixes, rest

    (theirs, recorded_rest), (mine, our_rest) = split(recorded), split(ours)
    if not KERAS3 or len(theirs) != 1 or len(mine) != 1 or theirs == mine or recorded_rest != our_rest:
        return None
    return next(iter(theirs)), next(iter(mine))


def _check_model(meta: dict[str, Any], model: tf.keras.Model, path: str) -> None:
    recorded = meta.get("model")
    if recorded is None:
        return  # an older mask: the variable names are still checked one by one
    ours = model_fingerprint(model)
    renamed = _renamed_model(recorded, ours)
    if renamed is not None:
        raise ValueError(
            f"mask {path} was selected for this architecture under another model name ({renamed[0]!r}, this "
            f"model is {renamed[1]!r}): Keras 3 puts a Sequential model's name in its variables' paths and "
            "names an unnamed model anew each time one is built in a process; give the model a fixed name "
            f"(name={renamed[0]!r})")
    if recorded != ours:
        first = (sorted(set(recorded) ^ set(ours)) or sorted(k for k in ours if recorded.get(k) != ours[k]))[0]
        raise ValueError(
            f"mask {path} was selected for another model ({len(recorded)} maskable kernels, this model has "
            f"{len(ours)}; first difference: {first} {recorded.get(first)} vs {ours.get(first)}); load a mask "
            "selected for this "
            "model architecture"
        )
