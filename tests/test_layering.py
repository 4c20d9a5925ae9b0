"""The library's layering: ``import sparta_tf`` is cheap and changes nothing, the top level is the public
surface, and the import graph of ``sparta_tf`` has no cycle and never reaches ``trainers``.

The import graph is read from the source (AST), not by importing: an edge ``a -> b`` for every
``import b`` / ``from b import x`` in module ``a`` that Python would execute, at module level *and*
inside functions (a function-local import is a dependency all the same, taken later; so it must not
close a cycle either: a cycle that only a late import keeps from failing is still a cycle). Imports
under ``if TYPE_CHECKING:`` never run and are left out. ``from p import x`` is an edge to ``p.x``
when that is a module, else to ``p``; importing ``p.q.r`` also runs the ``__init__`` of ``p.q``, so
that package is an edge too, unless it contains the importer (a module inside ``p.q`` runs only
once ``p.q`` has started).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sparta_tf"


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


# ------------------------------------------------------------------ import sparta_tf


def test_import_sparta_tf_leaves_the_environment_unchanged():
    code = ("import os, json; before = dict(os.environ); import sparta_tf; "
            "print(json.dumps(dict(os.environ) == before))")
    for env_level in (None, "0"):  # with and without a TF_CPP_MIN_LOG_LEVEL of the caller
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        if env_level is not None:
            env["TF_CPP_MIN_LOG_LEVEL"] = env_level
        env["PYTHONPATH"] = str(ROOT)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == "true", "import sparta_tf changed os.environ"


@pytest.mark.parametrize("statement", [
    "import sparta_tf",
    "import sparta_tf.method_spec",
    "from sparta_tf import method_spec",
    "import sparta_tf.data.spec",
    "import trainers.config",
])
def test_tensorflow_free_imports_do_not_import_tensorflow(statement):
    done = _python(f"import sys; {statement}; print(sorted(m for m in ('tensorflow', 'keras') "
                   "if m in sys.modules))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "[]", f"{statement!r} imported {done.stdout.strip()}"


def test_a_top_level_name_imports_its_module_on_first_use():
    done = _python("import sys, sparta_tf; assert 'tensorflow' not in sys.modules; "
                   "from sparta_tf.private_training import make_private; "
                   "assert sparta_tf.make_private is make_private; "
                   "assert 'sparta_tf.backend' in sys.modules; print(sparta_tf.make_private.__module__)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "sparta_tf.private_training"


# ------------------------------------------------------------------------ public surface

CORE = {"make_private", "DPModel", "PrivacyPlan", "PrivacyLedger", "Method", "METHODS", "NotPerExampleSafeError",
        "cosine_with_warmup", "calibrate_noise_multiplier", "compute_epsilon", "register_layer_rule"}
INTERNALS = {"group_table": "sparta_tf.groups", "row_groups": "sparta_tf.groups", "save_mask": "sparta_tf.masks",
             "load_mask": "sparta_tf.masks", "SpartaSelector": "sparta_tf.selection",
             "MethodCallback": "sparta_tf.callbacks", "SpartaCallback": "sparta_tf.callbacks"}


def test_the_top_level_is_the_entry_point_the_core_types_the_registries_and_the_guides_helpers():
    import importlib

    import sparta_tf

    assert CORE <= set(sparta_tf.__all__)
    assert set(sparta_tf.__all__) == set(sparta_tf._PUBLIC), "__all__ and the lazy table name the same names"
    assert not set(INTERNALS) & set(sparta_tf.__all__)
    for name in sparta_tf.__all__:
        assert getattr(sparta_tf, name) is not None, name
    assert isinstance(sparta_tf.__version__, str)
    for name, module in INTERNALS.items():
        assert hasattr(importlib.import_module(module), name), (name, module)
        with pytest.raises(AttributeError):
            getattr(sparta_tf, name)


def test_an_unknown_top_level_name_is_an_attribute_error():
    import sparta_tf

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        sparta_tf.no_such_name  # noqa: B018


# ------------------------------------------------------------------------ import graph


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of sparta_tf (a package's name for its ``__init__.py``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name an executed import statement of ``tree`` names (``p.x`` for ``from p import x``)."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names.update(f"{base}\0{alias.name}" for alias in child.names)
            stack.append(child)
    return names


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of sparta_tf (and any ``trainers`` module) that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for imported in _imported_names(ast.parse(path.read_text()), package):
        base, _, attribute = imported.partition("\0")
        target = f"{base}.{attribute}" if attribute and f"{base}.{attribute}" in modules else base
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            contains_importer = name == prefix or name.startswith(prefix + ".")
            if (prefix in modules or prefix.split(".")[0] == "trainers") and (i == len(parts) or not contains_importer):
                targets.add(prefix)
    targets.discard(name)
    return targets


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt in graph and nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_of_sparta_tf_has_no_cycle():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nothing_in_sparta_tf_imports_trainers():
    users = {name: sorted(t for t in targets if t.split(".")[0] == "trainers")
             for name, targets in _import_graph().items()}
    assert not {name: t for name, t in users.items() if t}, "sparta_tf must not depend on the CLI"


def test_the_graph_reader_sees_cycles_local_imports_and_type_checking_blocks():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import hidden\ndef f():\n    from .sib import g\n")
    assert _imported_names(tree, "pkg") == {"x", "pkg.sib\0g"}
    edges = _import_graph()
    assert "sparta_tf.models.convert" in edges["sparta_tf.models.zoo"] | edges["sparta_tf.models.saved"]
