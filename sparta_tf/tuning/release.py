"""A private tuning's release, written so that no byte of it depends on how many candidates ran or which
one won (:func:`write_release`; ``sparta-tune`` and :meth:`sparta_tf.tuning.library.TuningResult.save_release`).

The repeat-and-select analysis (:mod:`sparta_tf.privacy.tuning`) covers a release of the best
candidate's model, its values and its noisy score, and nothing else: once the number of candidates
``K`` or the winner's index is known, the guarantee falls back towards K-fold composition. So the
release is its own directory, apart from the private state, holding::

    model.keras        the winner's model, loaded and saved again by a fresh process: the zip's entry
                       times and metadata.json's date_saved fixed (:data:`RELEASE_TIME`)
    export/<version>/  the TF Serving SavedModel, exported by that fresh process (TensorFlow names
                       functions from a process-wide counter, which a fresh process starts at zero;
                       the random uuid of ``fingerprint.pb`` cleared)
    results.json       what :func:`released_results` keeps: the values, the noisy score, epsilon, ...
    ledger.json        the whole procedure's ledger (its caveats and reasons sorted, not in the order
                       the candidates ran)

and every file's and directory's modification time is :data:`RELEASE_TIME`. The fresh process does the
same work whatever ran before it, so two tunings that release the same winner's weights, values and
score write byte-identical directories (tests/test_release_privacy.py). The winner's model must carry
names that do not count candidates: ``sparta-tune`` builds every candidate in a fresh Keras name state,
``tune_privately`` restores the name state before every candidate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

RELEASE_DIR = "release"
RELEASE_TIME = 315532800  # 1980-01-01 00:00:00 UTC, the earliest time a zip entry can hold
ZIP_TIME = time.gmtime(RELEASE_TIME)[:6]
FIXED_DATE_SAVED = time.strftime("%Y-%m-%d@%H:%M:%S", time.gmtime(RELEASE_TIME))  # Keras's date_saved format
RELEASED_KEYS = ("released", "method", "private", "unit", "epsilon", "target_epsilon", "delta", "accountant",
                 "tuning", "per_run_epsilon", "privacy_caveats", "reason", "hyperparameters", "validation_score",
                 "noise_multiplier")
"""What ``results.json`` of a release holds (each when known). Not released: the number of candidates, the
winner's index, any noiseless accuracy (the test split may be carved from the private data), the
validation split's size and the score's noise (which give it away), paths and times."""


def released_results(results: dict) -> dict:
    """``results`` restricted to :data:`RELEASED_KEYS` (the caveats sorted)."""
    released = {key: results[key] for key in RELEASED_KEYS if key in results}
    if "privacy_caveats" in released:
        released["privacy_caveats"] = sorted(released["privacy_caveats"])
    return released


def canonical_ledger(ledger_json: dict) -> dict:
    """A ledger's JSON with its caveats and non-private reasons sorted (their order followed the candidates')."""
    return {**ledger_json, "caveats": sorted(ledger_json.get("caveats", [])),
            "nonprivate": sorted(ledger_json.get("nonprivate", []))}


def export_in_fresh_process(model: tf.keras.Model, export_dir: str, version: int | None = None,
                            preprocessing: dict | None = None) -> str:
    """:func:`export_for_serving` done by a fresh process, from ``model`` saved as ``.keras``; returns the new
    version directory (``version`` None: the next free number, as there).

    A SavedModel names its functions from a TensorFlow counter shared by the whole process, so an export
    made where the model trained counts the functions that process traced: how many batch shapes its
    padded Poisson batches took, how many evaluations ran. Those depend on the data, and no ledger covers
    them; a fresh process starts the counter at zero (the writer of a private tuning's release,
    :func:`sparta_tf.tuning.release.write_release`, which also clears ``fingerprint.pb``'s random uuid)."""
    from sparta_tf.export import _unwrap, next_version

    if version is not None and (not isinstance(version, (int, np.integer)) or version < 0):
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    export_dir = os.fspath(export_dir)
    os.makedirs(export_dir, exist_ok=True)
    number = next_version(export_dir) if version is None else int(version)
    target = os.path.join(export_dir, str(number))
    if os.path.exists(target):
        raise FileExistsError(f"export version {target!r} already exists; pick another version")
    work = tempfile.mkdtemp(prefix=".tmp-export-", dir=export_dir)
    try:
        saved = os.path.join(work, "model.keras")
        _unwrap(model).save(saved)
        release = write_release(os.path.join(work, "release"), {}, {}, saved, number, preprocessing)
        os.rename(os.path.join(release, "export", str(number)), target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def write_release(target: str, results: dict, ledger_json: dict, model_path: str | None = None,
                  export_version: int | None = None, preprocessing: dict | None = None) -> str:
    """Writes the release to ``target`` (replaced whole: a temporary sibling, then a rename) by a fresh
    process (module doc); returns ``target``. ``model_path``: the winner's ``.keras`` (None: nothing was
    released but the results and ledger); ``export_version``: also export it for serving;
    ``preprocessing``: :func:`sparta_tf.export.export_for_serving`'s (mean and std: scalars or per channel)."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".release-", dir=parent)
    try:
        request = {"results": released_results(results), "ledger": canonical_ledger(ledger_json),
                   "model": model_path, "export_version": export_version,
                   "preprocessing": None if preprocessing is None else
                   {key: np.asarray(value).tolist() for key, value in preprocessing.items()}}
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=parent, prefix=".release-request-",
                                         delete=False) as f:
            json.dump(request, f)
        try:
            environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")}
            process = subprocess.run([sys.executable, "-m", "sparta_tf.tuning.release", f.name, staging],
                                     capture_output=True, text=True, env=environment)
        finally:
            os.remove(f.name)
        if process.returncode:
            last = (process.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"writing the release in a fresh process failed: {last}")
        _fix_times(staging)
        old = None
        if os.path.isdir(target):  # moved aside whole, so that a kill leaves the old release or the new one
            old = tempfile.mkdtemp(prefix=".release-old-", dir=parent)
            os.replace(target, os.path.join(old, "release"))
        os.replace(staging, target)
        os.utime(target, (RELEASE_TIME, RELEASE_TIME))
        if old is not None:
            shutil.rmtree(old)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
    return target


def _write(request: dict, staging: str) -> None:
    """The fresh process's work: the model saved again and exported, the JSON files written."""
    with open(os.path.join(staging, "results.json"), "w") as f:
        json.dump(request["results"], f, indent=1, sort_keys=True)
    with open(os.path.join(staging, "ledger.json"), "w") as f:
        json.dump(request["ledger"], f, indent=1)
    if request["model"] is None:
        return
    from sparta_tf.export import export_for_serving
    from sparta_tf.models.convert import load_keras_model

    model = load_keras_model(request["model"])
    saved = os.path.join(staging, "model.keras")
    model.save(saved)
    _fix_zip(saved)
    if request["export_version"] is not None:
        preprocessing = request["preprocessing"]
        version_dir = export_for_serving(model, os.path.join(staging, "export"), version=request["export_version"],
                                         preprocessing=preprocessing)
        _fix_fingerprint(version_dir)


def _fix_fingerprint(saved_model_dir: str) -> None:
    """Clears the random ``uuid`` TensorFlow >= 2.16 writes into ``fingerprint.pb`` (the hashes of the
    SavedModel's content stay): a value that differs between two exports of the same model."""
    path = os.path.join(saved_model_dir, "fingerprint.pb")
    if not os.path.exists(path):
        return
    from tensorflow.core.protobuf import fingerprint_pb2

    fingerprint = fingerprint_pb2.FingerprintDef()
    with open(path, "rb") as f:
        fingerprint.ParseFromString(f.read())
    if "uuid" in fingerprint.DESCRIPTOR.fields_by_name:
        fingerprint.ClearField("uuid")
    with open(path, "wb") as f:
        f.write(fingerprint.SerializeToString(deterministic=True))


def _fix_zip(path: str) -> None:
    """Rewrites the ``.keras`` zip with fixed entry times and ``metadata.json``'s ``date_saved`` fixed."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in entries:
            if info.filename == "metadata.json":
                metadata = json.loads(data)
                metadata["date_saved"] = FIXED_DATE_SAVED
                data = json.dumps(metadata).encode()
            fixed = zipfile.ZipInfo(info.filename, date_time=ZIP_TIME)
            fixed.compress_type, fixed.external_attr = info.compress_type, info.external_attr
            archive.writestr(fixed, data)


def _fix_times(root: str) -> None:
    """Every file's and directory's access and modification times set to :data:`RELEASE_TIME`."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            os.utime(os.path.join(directory, name), (RELEASE_TIME, RELEASE_TIME))
        os.utime(directory, (RELEASE_TIME, RELEASE_TIME))


def main(argv: list[str]) -> int:
    request_path, staging = argv
    with open(request_path) as f:
        request = json.load(f)
    _write(request, staging)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
