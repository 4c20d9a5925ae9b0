"""MkDocs hooks: the pages generated from the code (see ``docs/gen_reference.py``).

* ``on_config``: the API reference's navigation, one page per public module of ``sparta_tf``;
* ``on_files``: those API pages, and the committed benchmark reports and plots
  (``benchmarks/README.md``, ``benchmarks/results/*.md``, ``*.png``) so that the result pages
  can link and show them;
* ``on_page_markdown``: a page's ``<!-- generated:NAME -->`` marker replaced by the generated
  Markdown (the config tables, the console scripts' ``--help``, the code layout).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_reference as gen  # noqa: E402

API_SECTION = "API reference"
GENERATED = {
    "<!-- generated:config-tables -->": gen.config_tables,
    "<!-- generated:cli-help -->": gen.cli_reference,
    "<!-- generated:layout -->": gen.layout_table,
}


def on_config(config):
    modules = gen.api_modules()
    for entry in config.nav or []:
        if isinstance(entry, dict) and API_SECTION in entry:
            entry[API_SECTION] = ["api/index.md"] + [{module: f"api/{module}.md"} for module in modules]
    return config


def on_files(files, config):
    modules = gen.api_modules()
    files.append(File.generated(config, "api/index.md", content=gen.api_index(modules)))
    for module in modules:
        files.append(File.generated(config, f"api/{module}.md", content=gen.api_page(module)))
    results = gen.ROOT / "benchmarks" / "results"
    for path in [gen.ROOT / "benchmarks" / "README.md", *sorted(results.glob("*.md")), *sorted(results.glob("*.png"))]:
        files.append(File.generated(config, path.relative_to(gen.ROOT).as_posix(), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
