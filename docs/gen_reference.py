"""Reference pages generated from the code, so that they cannot go stale.

Used by the MkDocs hook (``docs/hooks.py``) at every ``mkdocs build``; importable without
TensorFlow (tests call it directly):

* :func:`config_tables` -- the ``sparta-train`` config reference, from the config spec that
  ``trainers.config`` checks configs against (keys, types, defaults, valid values, which
  method takes which option) and the ``data:`` keys of ``sparta_tf/data/spec.py``;
* :func:`cli_help` -- the ``--help`` of every console script named in ``pyproject.toml``;
* :func:`api_modules` / :func:`api_page` -- one API page per public module of ``sparta_tf``
  (rendered by mkdocstrings from the docstrings);
* :func:`layout_table` -- the code layout: every module with the first line of its docstring.

Nothing here imports TensorFlow: the config checker is TensorFlow-free by design, console
scripts parse their arguments before they import it, and the rest reads source files.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import importlib.util
import io
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ensure_root_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# --- the config reference -------------------------------------------------------------------------

_TYPE_NAMES = {int: "integer", float: "number", bool: "bool", str: "string", dict: "mapping",
               list: "list", tuple: "list", type(None): "null"}
# Values tried on a key's check until one is refused; the refusal ("must be in [0, 1]") is the rule.
_PROBES = ("\x00not-a-choice", -1e9, 1e9, -1, 0, 0.5, 1, 2, {"*": 2.0}, {"*": -1.0})


def _config_module():
    _ensure_root_on_path()
    return importlib.import_module("trainers.config")


def _yaml_value(value) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, float) and (abs(value) < 1e-3 and value != 0):
        return f"{value:g}"
    return str(value)


def _types(field) -> str:
    names = dict.fromkeys(_TYPE_NAMES.get(t, getattr(t, "__name__", str(t))) for t in field.types)
    if "integer" in names and "number" in names:
        del names["integer"]
    return " or ".join(names)


def _rule(field) -> str:
    """The key's valid values, in the words of its own check (``must be ...``)."""
    check = getattr(field, "check", None)
    if check is None:
        return ""
    for probe in _PROBES:
        if isinstance(probe, str) and str not in field.types:
            continue
        if isinstance(probe, dict) and dict not in field.types:
            continue
        if isinstance(probe, (int, float)) and not any(t in field.types for t in (int, float)):
            continue
        try:
            problem = check(probe)
        except Exception:  # noqa: BLE001 - a check that cannot take this probe's type
            continue
        if problem:
            problem = problem.split("; ")[-1]
            for prefix in ("every density ", "must be "):
                if problem.startswith(prefix):
                    problem = problem[len(prefix):]
            return problem.replace("must be ", "")
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _literal_assignments(path: Path) -> dict:
    """Top-level ``NAME = literal`` (or ``frozenset({...})``) assignments of a source file."""
    values = {}
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if not isinstance(target, ast.Name) or node.value is None:
            continue
        try:
            values[target.id] = _literal(node.value)
        except ValueError:
            continue
    return values


def _literal(node):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set"):
        return frozenset(_literal(node.args[0])) if node.args else frozenset()
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def data_keys_table() -> str:
    """The ``data:`` keys per source, from ``sparta_tf/data/spec.py`` (read, not imported)."""
    spec = _literal_assignments(ROOT / "sparta_tf" / "data" / "spec.py")
    common, per_source = spec["COMMON_KEYS"], spec["SOURCE_KEYS"]
    lines = ["| `data.source` | keys of this source (besides the common ones) |", "| --- | --- |"]
    for source, keys in per_source.items():
        lines.append(f"| `{source}` | {', '.join(f'`{k}`' for k in sorted(keys)) or '-'} |")
    head = "Keys every source accepts: " + ", ".join(f"`{k}`" for k in sorted(common)) + "."
    normalizations = spec.get("NORMALIZATIONS")
    if normalizations:
        head += " `normalize`: " + " or ".join(f"`{n}`" for n in normalizations) + "."
    return head + "\n\n" + "\n".join(lines) + "\n"


_MINIMAL_CONFIG = {"data": {"source": "digits"}, "model": {"name": "resnet20_gn"}, "output_dir": "runs/x"}


def _section_table(section: str, fields: dict) -> list[str]:
    out = ["| key | type | default | valid values |", "| --- | --- | --- | --- |"]
    for key, field in fields.items():
        default = "required" if getattr(field, "required", False) else f"`{_yaml_value(field.default)}`"
        out.append(f"| `{section}.{key}` | {_types(field)} | {default} | {_cell(_rule(field))} |")
    return out


def _method_section_from_spec(spec_module, default_name: str) -> list[str]:
    """The ``method`` section from :mod:`sparta_tf.method_spec`: every method, its phases and options."""
    methods = spec_module.SPECS
    out = ["| key | type | default | valid values |", "| --- | --- | --- | --- |",
           f"| `method.name` | string | `{default_name}` | {', '.join(methods)} |", "",
           "The other keys of the section are the options of the method `method.name` names:", ""]
    out += ["| `method.name` | what it trains | options |", "| --- | --- | --- |"]
    for name, spec in methods.items():
        options = ", ".join(f"`{o.name}`" for o in spec.options) or "-"
        out.append(f"| [`{name}`](#{name}-options) | {_cell(spec.summary)} | {options} |")
    for name, spec in methods.items():
        out.append(f"\n### `{name}` {{#{name}-options}}\n")
        out.append(_cell(spec.summary) + ("" if spec.private else " **Not differentially private.**"))
        out.append("")
        if spec.before_training:
            out += [f"Before training: {_cell(spec.before_training)}.", ""]
        out += ["| phase | epochs | trains |", "| --- | --- | --- |"]
        out += [f"| `{p.name}` | {_cell(p.length)} | {_cell(p.trains)} |" for p in spec.phases]
        if spec.options:
            out += ["", "| option | type | default | valid values | meaning |", "| --- | --- | --- | --- | --- |"]
            for option in spec.options:
                kinds = dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in option.types if t is not type(None))
                if "integer" in kinds and "number" in kinds:
                    del kinds["integer"]
                valid = str(option.valid) if option.valid is not None else ""
                out.append(f"| `method.{option.name}` | {' or '.join(kinds)} | `{_yaml_value(option.default)}` | "
                           f"{_cell(valid)} | {_cell(option.doc)} |")
        else:
            out += ["", "No options of its own."]
    return out


def _method_section_from_options(config) -> list[str]:
    """The ``method`` section from ``trainers.config``'s ``SCHEMA["method"]`` and ``METHOD_OPTIONS``."""
    method_options, scores = config.METHOD_OPTIONS, getattr(config, "SCORES", {})
    out = ["| key | type | default | valid values | methods |", "| --- | --- | --- | --- | --- |"]
    for key, field in config.SCHEMA["method"].items():
        rule = _rule(field)
        if key == "score" and scores:
            rule = "; ".join(f"{m}: {' or '.join(v)}" for m, v in scores.items())
        if key == "name":
            rule = ", ".join(method_options)
        users = "every method" if key == "name" else ", ".join(m for m, o in method_options.items() if key in o) or "-"
        out.append(f"| `method.{key}` | {_types(field)} | `{_yaml_value(field.default)}` | {_cell(rule)} | {users} |")
    out += ["\n### Options per method\n", "| `method.name` | its options | `method.score` |", "| --- | --- | --- |"]
    for name, options in method_options.items():
        opts = ", ".join(f"`{o}`" for o in options) or "-"
        out.append(f"| `{name}` | {opts} | {' or '.join(f'`{s}`' for s in scores.get(name, ())) or '-'} |")
    return out


def config_tables() -> str:
    """Markdown: one section per config section (the method section per method), then the data keys."""
    config = _config_module()
    schema = config.SCHEMA
    defaults = config.validate(copy.deepcopy(_MINIMAL_CONFIG))
    spec_module = getattr(config, "method_spec", None)
    sections = [s for s in getattr(config, "TOP_LEVEL", tuple(schema)) if s != "notes"]
    required = ", ".join(f"`{k}`" for k in getattr(config, "REQUIRED_TOP_LEVEL", ()))
    out = [f"Top-level keys: {', '.join(f'`{s}`' for s in sections)}" + (f" (required: {required})." if required else ".")]
    for section in sections:
        if section == "output_dir":
            out += ["\n## `output_dir`\n", "Required: the run directory (a string path)."]
            continue
        out.append(f"\n## `{section}`\n")
        if section == "method":
            out += (_method_section_from_spec(spec_module, defaults["method"]["name"]) if spec_module is not None
                    else _method_section_from_options(config))
        elif section == "tuning":
            out += _tuning_section()
        elif not schema.get(section):
            out.append(f"Free-form: the keys are checked by the {section} loader "
                       f"([`{section}` keys](#{section}-keys)).")
        else:
            out += _section_table(section, schema[section])
    out.append("\n## `data` keys {#data-keys}\n")
    out.append(data_keys_table())
    return "\n".join(out) + "\n"


def _tuning_section() -> list[str]:
    """The ``tuning`` section's keys (``trainers/tuning_config.py``'s ``DEFAULTS``, read without importing it)."""
    defaults = _literal_assignments(ROOT / "trainers" / "tuning_config.py").get("DEFAULTS", {})
    rows = ["Read by `sparta-tune` only ([Tuning hyperparameters privately](../tuning.md)); `sparta-train` "
            "ignores it with a note.", "", "| key | default |", "|---|---|"]
    return rows + [f"| `tuning.{key}` | `{_yaml_value(value)}` |" for key, value in defaults.items()]


# --- the CLI reference ----------------------------------------------------------------------------

def console_scripts() -> dict[str, str]:
    """``pyproject.toml``'s ``[project.scripts]``: command -> ``module:function``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"].get("scripts", {}))


def _load_by_path(module: str):
    """Executes a module's file without importing its package (``sparta_tf/__init__`` imports
    TensorFlow; the scripts' argument parsers do not need it)."""
    _ensure_root_on_path()
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    name = "_sparta_docs_" + module.replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # dataclasses look their module up there
    spec.loader.exec_module(loaded)
    return loaded


def cli_help(command: str, target: str, columns: int = 100) -> str:
    """The ``--help`` text of one console script."""
    module, function = target.split(":")
    old, old_argv = os.environ.get("COLUMNS"), sys.argv
    os.environ["COLUMNS"] = str(columns)
    sys.argv = [command]  # argparse's default prog
    buffer = io.StringIO()
    try:
        entry = getattr(_load_by_path(module), function)
        with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
            entry(["--help"])
    finally:
        sys.argv = old_argv
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    text = buffer.getvalue()
    if "usage:" not in text:
        raise RuntimeError(f"{command} --help printed no usage; does {target} parse its arguments first?")
    return text


def cli_reference() -> str:
    parts = []
    for command, target in console_scripts().items():
        parts.append(f"## `{command}`\n\n`{target}`\n\n```text\n{cli_help(command, target).rstrip()}\n```\n")
    return "\n".join(parts)


# --- the API reference and the layout -------------------------------------------------------------

def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line."""
    paragraph = _docstring(path).strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def api_modules(package: str = "sparta_tf") -> list[str]:
    """The package, its sub-packages and its public top-level modules (dotted names)."""
    base = ROOT / package
    names = [package]
    for child in sorted(base.iterdir()):
        if child.name.startswith("_"):
            continue
        if child.is_dir() and (child / "__init__.py").exists():
            names.append(f"{package}.{child.name}")
        elif child.suffix == ".py":
            names.append(f"{package}.{child.stem}")
    return names


def api_page(module: str) -> str:
    return (f"# `{module}`\n\n::: {module}\n    options:\n      show_root_heading: false\n"
            f"      show_root_toc_entry: false\n")


def api_index(modules: list[str]) -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by mkdocstrings (static analysis: nothing is imported).", "",
             "| module | what |", "| --- | --- |"]
    for module in modules:
        path = ROOT.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        lines.append(f"| [`{module}`]({module}.md) | {_cell(_plain(_summary(path)))} |")
    return "\n".join(lines) + "\n"


def _plain(text: str) -> str:
    """A docstring line in Markdown: ``x`` -> `x`, :role:`x` -> `x`."""
    import re

    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def layout_table() -> str:
    """Every package and module of ``sparta_tf`` and ``trainers``, and every script of
    ``benchmarks``, with the first line of its docstring."""
    lines = ["| path | what |", "| --- | --- |"]
    for top in ("sparta_tf", "trainers", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if any(part.startswith((".", "__pycache__")) for part in rel.parts):
                continue
            doc = _summary(path)
            if path.name == "__init__.py":
                rel = rel.parent
                shown = f"`{rel}/`"
            else:
                shown = f"`{rel}`"
            if path.name in ("__main__.py",) or (path.name == "__init__.py" and not doc):
                continue
            lines.append(f"| {shown} | {_cell(_plain(doc))} |")
    return "\n".join(lines) + "\n"
