"""The docs machinery: runnable-block extraction and reporting, the generated reference pages.

Cheap (no TensorFlow in this process; a few small subprocesses). CI runs the runnable blocks
themselves with ``docs/run_examples.py`` and builds the site with ``mkdocs build --strict``.
Select with ``pytest -m docs``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
QUICKSTART = ("python3 -m venv .venv && .venv/bin/pip install -e . && "
              ".venv/bin/sparta-train --config configs/quickstart.yaml")
TESTS = 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest -n 2'


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


runner = _load("run_examples")


def test_extract_finds_marked_blocks_with_their_fence_line(tmp_path):
    page = tmp_path / "page.md"
    text = "\n".join([
        "# Title", "",
        "```python", "print('not marked')", "```", "",
        "<!-- runnable -->", "```python", "print('one')", "```", "",
        "* a list item:", "",
        "  <!-- runnable: exit=2, timeout=30 -->", "  ```bash", "  exit 2", "  ```", "",
    ])
    blocks = runner.extract(page, text)
    assert [(b.line, b.language, b.code, b.exit_status, b.timeout) for b in blocks] == [
        (8, "python", "print('one')\n", 0, runner.DEFAULT_TIMEOUT),
        (15, "bash", "exit 2\n", 2, 30),
    ]


@pytest.mark.parametrize("text, problem", [
    ("<!-- runnable -->\n\n```python\nx = 1\n```\n", "right before a fenced code block"),
    ("<!-- runnable -->\n```yaml\nx: 1\n```\n", "runnable block in 'yaml'"),
    ("<!-- runnable: retries=3 -->\n```python\nx = 1\n```\n", "unknown runnable option"),
    ("<!-- runnable -->\n```python\nx = 1\n", "never closed"),
])
def test_a_marker_that_marks_nothing_runnable_is_an_error(tmp_path, text, problem):
    with pytest.raises(runner.MarkerError, match=problem):
        runner.extract(tmp_path / "page.md", text)


def test_every_runnable_block_of_the_readme_and_docs_parses():
    blocks = runner.collect()
    assert any(b.path.name == "README.md" and b.language == "python" for b in blocks)
    problems = {b.where: runner.check_syntax(b) for b in blocks}
    assert {where: p for where, p in problems.items() if p} == {}


def test_a_failing_block_reports_its_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- runnable -->\n```python\nprint('fine')\n```\n")
    (tmp_path / "docs" / "page.md").write_text("text\n\n<!-- runnable -->\n```python\nraise SystemExit(3)\n```\n")
    blocks = runner.collect(tmp_path)
    results = [runner.run_block(b) for b in blocks]
    assert [r[0] for r in results] == [True, False]
    assert blocks[1].where.endswith("docs/page.md:4")
    assert "exit status 3, expected 0" in results[1][1]


def test_the_readme_keeps_the_first_screen_commands_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert QUICKSTART in readme and TESTS in readme
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    assert TESTS in ci
    assert "mkdocs build --strict" in ci and "docs/run_examples.py" in ci


def test_reference_pages_are_generated_from_the_config_spec_without_tensorflow():
    script = """
import json, sys
sys.path.insert(0, "docs")
import gen_reference as gen
from trainers import config
tables = gen.config_tables()
helps = {c: gen.cli_help(c, t) for c, t in gen.console_scripts().items()}
print(json.dumps({"tables": tables, "helps": helps, "modules": gen.api_modules(),
                  "tensorflow": "tensorflow" in sys.modules,
                  "keys": [f"{s}.{k}" for s, fields in config.SCHEMA.items() for k in fields],
                  "methods": list(config.METHOD_NAMES)}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    assert not out["tensorflow"]
    for key in out["keys"]:
        assert f"`{key}`" in out["tables"], key
    for method in out["methods"]:
        assert f"`{method}`" in out["tables"], method
    assert set(out["helps"]) >= {"sparta-train", "sparta-check-export", "sparta-audit", "sparta-example"}
    assert all(text.startswith("usage: ") for text in out["helps"].values())
    assert "sparta_tf" in out["modules"] and "sparta_tf.privacy" in out["modules"]


def test_the_zoo_speed_table_is_written_into_a_docs_page_that_has_its_markers():
    tree = ast.parse((ROOT / "benchmarks" / "zoo_speed.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            values.update((t.id, v) for t, v in zip(node.targets[0].elts, node.value.elts))

    def parts(node):  # ROOT / "docs" / "speed.md" -> ["docs", "speed.md"]
        if isinstance(node, ast.BinOp):
            return parts(node.left) + parts(node.right)
        return [node.value] if isinstance(node, ast.Constant) else []

    page = ROOT.joinpath(*parts(values["README"]))
    assert page.is_relative_to(DOCS) and page.exists()
    text = page.read_text()
    for line in ("", "_KERAS3"):  # a table per Keras line
        begin, end = values[f"README{line}_BEGIN"].value, values[f"README{line}_END"].value
        assert text.index(begin) < text.index(end)
