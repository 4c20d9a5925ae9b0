"""A ``.tar.gz``/``.tgz``/``.tar`` archive of image folders, extracted once into a cache.

The archive is extracted to ``<cache_dir>/<stem>-<key>/`` where ``key`` hashes
the archive's absolute path, size and modification time (a changed archive
gets a fresh cache). ``cache_dir`` defaults to ``<tmp>/sparta_tf_data-<uid>``.

The extracted images are the private data: the cache folder and every extraction are private to the
user (``0700``), and an extraction owned by another user is never read (it could be planted: its
name follows from the archive's path, size and time).

Extraction is atomic: files go to a hidden ``.<stem>-<key>.partial-<pid>-*``
folder that is renamed to its final name only once complete, so an
interrupted or killed extraction never leaves a half cache that a later call
would trust. A failed extraction removes its partial folder; one left by a
killed process (whose pid no longer runs) is removed by the next call.
Members are extracted with the ``"data"`` filter (no absolute paths, links
out of the tree or device files).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path

from sparta_tf.data.errors import key_error
from sparta_tf.data.raw import RawData
from sparta_tf.data.sources.folder import load_image_tree
from sparta_tf.data.spec import DataSpec

__all__ = ["DEFAULT_CACHE_DIR", "archive_stem", "extract_cached", "load_tar"]

DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / (
    f"sparta_tf_data-{os.getuid()}" if hasattr(os, "getuid") else "sparta_tf_data")
"""Where archives are extracted when ``data.cache_dir`` is not set."""

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def load_tar(spec: DataSpec, seed: int) -> RawData:
    """Extracts ``spec.path`` (once) and reads it as image folders."""
    archive = spec.path
    if not archive.is_file():
        raise key_error("path", f"no such file {str(archive)!r}", "point data.path at a .tar.gz archive")
    root = extract_cached(archive, spec.cache_dir or DEFAULT_CACHE_DIR)
    return load_image_tree(root, spec, archive_stem(archive))


def archive_stem(archive: Path) -> str:
    """``cifar10-jpg`` for ``cifar10-jpg.tar.gz`` (and ``.tgz``, ``.tar``)."""
    name = archive.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def cache_key(archive: Path) -> str:
    """``<stem>-<hash of absolute path, size, mtime>``."""
    stat = archive.stat()
    identity = f"{archive.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{archive_stem(archive)}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def extract_cached(archive: Path, cache_dir: Path) -> Path:
    """The extracted copy of ``archive`` under ``cache_dir``, extracting it if absent."""
    key = cache_key(archive)
    final = cache_dir / key
    if final.is_dir():
        return _owned(final)
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise key_error("cache_dir", f"cannot create {str(cache_dir)!r} ({error.strerror})",
                        "set data.cache_dir to a writable folder") from None
    remove_stale_partials(cache_dir, key)
    partial = Path(tempfile.mkdtemp(prefix=f".{key}.partial-{os.getpid()}-", dir=cache_dir))
    try:
        _extract(archive, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        os.rename(partial, final)  # private, as mkdtemp made it: the images are the private data
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        if final.is_dir():  # another process finished the same extraction first
            return _owned(final)
        raise key_error("cache_dir", f"cannot rename the extracted archive into {str(final)!r} "
                        f"({error.strerror})", "set data.cache_dir to a writable folder") from None
    return final


def _owned(extracted: Path) -> Path:
    """``extracted`` when this user owns it, else a one-line error: another user's folder of that name could
    hold other images (planted) and be read by others."""
    if hasattr(os, "getuid") and extracted.stat().st_uid != os.getuid():
        raise key_error("cache_dir", f"the extracted archive {str(extracted)!r} belongs to another user",
                        "set data.cache_dir to a folder of your own")
    return extracted


def _relative_members_only(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo:
    """tarfile's ``data`` filter, refusing (instead of rewriting) absolute and ``..`` member paths."""
    parts = Path(member.name).parts
    if member.name.startswith(("/", "\\")) or ".." in parts:
        raise key_error("path", f"archive member {member.name!r} has an absolute path or '..'",
                        "re-create the archive with relative paths (tar -C <folder> -czf data.tar.gz .)")
    return tarfile.data_filter(member, path)


def _extract(archive: Path, target: Path) -> None:
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter=_relative_members_only)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise key_error("path", f"cannot extract {str(archive)!r} ({error})",
                        "the archive is corrupt or truncated; re-create or re-download it") from None
    except OSError as error:
        raise key_error("cache_dir", f"cannot extract {str(archive)!r} into {str(target.parent)!r} "
                        f"({error})", "free disk space or set data.cache_dir to another folder") from None


def remove_stale_partials(cache_dir: Path, key: str) -> None:
    """Deletes partial extractions of ``key`` whose extracting process is gone."""
    for partial in cache_dir.glob(f".{key}.partial-*"):
        pid = partial.name[len(f".{key}.partial-"):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
