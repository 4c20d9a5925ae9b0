"""Lazy package exports (PEP 562): a package's public names imported on first access.

A package ``P`` that calls::

    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"name": "P.module", ...})

imports nothing when it is imported; ``P.name`` imports ``P.module`` then, returns its ``name``
and caches it in ``P``'s namespace (the next access is an ordinary attribute). A name that is
not exported but is a submodule (``P.sub``) is imported as ``P.sub``; anything else is an
``AttributeError``, as for any module. ``before`` runs once before the first export is imported
(the top-level package checks the Keras behind ``tf.keras`` there).

So a TensorFlow-free module of the package (``sparta_tf.method_spec``, ``sparta_tf.data.spec``,
``sparta_tf.dp_step.clipping``) imports without importing the rest, and lower layers can import
one part of a package without importing the parts that build on them. Standard library only.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, namespace: dict, exports: Mapping[str, str],
                 before: Callable[[], Any] | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public names are ``exports`` (name -> module)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if name in exports:
            if before is not None:
                before()
            value = getattr(importlib.import_module(exports[name]), name)
        else:
            value = _submodule(package, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def _submodule(package: str, name: str) -> Any:
    """``package.name`` imported, or the ``AttributeError`` of a missing attribute."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
