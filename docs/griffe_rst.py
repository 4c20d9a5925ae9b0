"""A griffe extension: the reStructuredText spellings of sparta_tf's docstrings, read as Markdown.

The docstrings use Sphinx roles (``:class:`Method```, ``:func:`~sparta_tf.x.f```) and a few
simple tables (rows of ``====`` columns). mkdocstrings renders Markdown, so before rendering

* a role becomes inline code of its target (``~`` drops the module path, as Sphinx shows it);
* a simple table becomes a fenced text block, kept as written.

Nothing else changes: double-backtick literals and ``::`` blocks indented by four spaces are
already Markdown.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const|ref|doc):`(~?)([^`]+)`")
TABLE_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")


def _role(match: re.Match) -> str:
    tilde, target = match.groups()
    if tilde:
        target = target.rsplit(".", 1)[-1]
    return f"`{target.lstrip('.')}`"


def rst_to_markdown(text: str) -> str:
    text = ROLE.sub(_role, text)
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if TABLE_RULE.match(lines[i]):
            rules = [j for j in range(i, len(lines)) if TABLE_RULE.match(lines[j])][:3]
            end = rules[-1] if len(rules) == 3 else (rules[1] if len(rules) == 2 else i)
            out += ["```text", *lines[i:end + 1], "```"]
            i = end + 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring with :func:`rst_to_markdown` when it is loaded."""

    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
