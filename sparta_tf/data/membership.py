"""Stable split membership: each example's split is decided by a keyed hash of its own content.

For a split key ``K`` (a 63-bit integer) and a purpose ``p`` (``test_split``, ``val_split``,
``limit_train``, ``limit_test``)::

    digest(x) = BLAKE2b-128(label(x) || dtype || shape || bytes(image(x)))
    u_p(x)    = BLAKE2b-64(key = K || p, data = digest(x)) / 2^64          in [0, 1)

and ``x`` is held out for purpose ``p`` at fraction ``f`` iff ``u_p(x) < f``
(:func:`held_out`). ``u_p(x)`` reads only ``x`` and the key, so adding, removing or
reordering *other* examples never changes ``x``'s split: a data set with one example more or
less gives splits that differ in that example only, which is the neighbouring relation the
privacy ledger's epsilon is stated for. The splits' sizes are binomial (``f n`` on average),
not exact counts: an exact count cannot be stable (one more example would have to push
another one out). Identical examples share a digest and so a split. The purposes hash
independently, so the validation split of the examples left after the test carve is again a
fraction ``f`` of them.

Limits (``data.limit_train`` / ``limit_test``: at most ``m`` examples) keep the ``m`` examples of
smallest ``u_p`` (:func:`smallest`): one added example either stays out or displaces exactly one
other, a replace-one neighbour (the caveat the data set records, :mod:`sparta_tf.data.dataset`).

Image files (the folder and tar sources) hash what the files are, not what decoding makes of them nor
where their class falls among the folders: ``digest(x) = BLAKE2b-128("file|" || class name || bytes(file))``
(:meth:`~sparta_tf.data.sources.folder.FileSplit.content_keys`). A label's number is its folder's rank
among the class folders, and the decoded pixels follow the channel count read off the first image, so
either would let one added image (a new class folder, a grayscale first file) move other images.

With user ids (``data.user_key``) the digest is the user's, ``digest(v) = BLAKE2b-128("user|" || id(v))``
(:func:`user_digests`): a user's examples are held out together, never split across training,
validation and test, and adding or removing a user changes the membership of that user's examples only.

The key must stay as secret as the data when the ``splits`` a run used should not be
recomputable from the data (``sparta-train`` draws a secret one per run by default); a known
key (``data.split_seed``, ``training.seed``) is recorded as a caveat.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sparta_tf.data.raw import Split

__all__ = ["CHUNK", "content_digests", "held_out", "smallest", "uniform_scores", "user_digests"]

CHUNK = 1024
"""Images read at a time while hashing (a chunk of CIFAR-sized images is ~3 MB)."""


def content_digests(split: Split, index: np.ndarray) -> list[bytes]:
    """``digest(x)`` (module doc) of the examples at ``index`` of ``split``: their labels and image bytes."""
    content_keys = getattr(split, "content_keys", None)
    if content_keys is not None:
        return [hashlib.blake2b(key, digest_size=16).digest() for key in content_keys(index)]
    digests: list[bytes] = []
    for start in range(0, len(index), CHUNK):
        positions = index[start:start + CHUNK]
        images = np.ascontiguousarray(split.images(positions))
        labels = np.asarray(split.labels)[positions].astype("<i8")
        header = f"{images.dtype.str}|{images.shape[1:]}|".encode()
        for label, image in zip(labels, images):
            digests.append(hashlib.blake2b(label.tobytes() + header + image.tobytes(), digest_size=16).digest())
    return digests


def user_digests(users: np.ndarray) -> list[bytes]:
    """``digest(v)`` of each example's user ``v`` (``data.user_key``), in place of its content: every example
    of one user shares the user's score, so a user is held out whole, and one user more or less changes only
    that user's examples' splits (the neighbouring relation of user-level DP)."""
    return [hashlib.blake2b(b"user|" + str(user).encode(), digest_size=16).digest() for user in users]


def uniform_scores(digests: list[bytes], key: int, purpose: str) -> np.ndarray:
    """``u_purpose`` (module doc) of each digest: float64 in ``[0, 1)``, uniform over keys."""
    salt = int(key).to_bytes(8, "little") + purpose.encode()
    values = [int.from_bytes(hashlib.blake2b(d, digest_size=8, key=salt).digest(), "little") for d in digests]
    return np.asarray(values, dtype=np.float64) / 2.0**64


def held_out(scores: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``(taken, rest)``: taken iff the score is below ``fraction`` (each position on its own)."""
    taken = scores < fraction
    return np.flatnonzero(taken), np.flatnonzero(~taken)


def smallest(scores: np.ndarray, count: int) -> np.ndarray:
    """The positions of the ``count`` smallest scores, in position order (the limits' bottom-k sample)."""
    if count >= len(scores):
        return np.arange(len(scores))
    return np.sort(np.argsort(scores, kind="stable")[:count])
