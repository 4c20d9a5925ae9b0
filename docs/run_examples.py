"""Runs the code blocks of README.md and docs/ that are marked runnable, so a wrong command fails CI.

A block is runnable when the line right before its opening fence is the HTML comment
``<!-- runnable -->`` (invisible on GitHub and on the docs site)::

    <!-- runnable -->
    ```python
    import sparta_tf as st
    ...
    ```

``<!-- runnable: exit=2 -->`` expects that exit status instead of 0 (a documented error);
``<!-- runnable: timeout=900 -->`` raises the per-block limit (default 600 s).

* ``python`` blocks run as a script in a fresh interpreter (this one's), in an empty
  temporary directory, with ``TF_CPP_MIN_LOG_LEVEL=3`` and the repository first on
  ``PYTHONPATH``;
* ``bash`` blocks run with ``bash -euo pipefail`` in an empty temporary directory that holds
  links to the repository's ``configs/`` and ``data/`` and a ``.venv`` link to this
  interpreter's environment, whose ``bin/`` is first on ``PATH`` (so ``sparta-train`` and
  ``.venv/bin/python`` are this environment's); keep them cheap.

A block repeated verbatim on several pages runs once. A failure prints ``FILE:LINE`` of the block (its opening fence), the exit status and the end of
its output, and the script exits 1. A marker that is not followed by a fenced block, or a
runnable block in another language, is an error too.

    python docs/run_examples.py                 # every runnable block
    python docs/run_examples.py --list          # where they are
    python docs/run_examples.py --only README   # blocks whose FILE:LINE contains README
    python docs/run_examples.py --check         # syntax only: compile / bash -n (no run)
    python docs/run_examples.py --jobs 1        # one block at a time (default: 2 at once)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^\s*<!--\s*runnable(?::\s*(?P<options>[^>]*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
DEFAULT_TIMEOUT = 600
TAIL = 3000  # characters of a failing block's output to show


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # python or bash
    code: str
    exit_status: int = 0
    timeout: int = DEFAULT_TIMEOUT

    @property
    def where(self) -> str:
        try:
            shown = self.path.relative_to(ROOT)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"


class MarkerError(ValueError):
    """A ``runnable`` marker that does not mark a block this script can run."""


def _options(text: str | None, where: str) -> dict:
    options = {}
    for item in (text or "").replace(",", " ").split():
        key, sep, value = item.partition("=")
        if key not in ("exit", "timeout") or not sep or not value.isdigit():
            raise MarkerError(f"{where}: unknown runnable option {item!r}; use exit=N or timeout=SECONDS")
        options["exit_status" if key == "exit" else "timeout"] = int(value)
    return options


def extract(path: Path, text: str | None = None) -> list[Block]:
    """The runnable blocks of one Markdown file."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if not marker:
            i += 1
            continue
        where = f"{path}:{i + 1}"
        options = _options(marker.group("options"), where)
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise MarkerError(f"{where}: <!-- runnable --> must be the line right before a fenced code block")
        language = LANGUAGES.get(fence.group("lang").lower())
        if language is None:
            raise MarkerError(f"{where}: runnable block in {fence.group('lang') or 'no language'!r}; "
                              f"mark only {', '.join(sorted(set(LANGUAGES.values())))} blocks")
        indent, closing = fence.group("indent"), fence.group("fence")
        body = []
        j = i + 2
        while j < len(lines) and not lines[j].strip().startswith(closing):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise MarkerError(f"{path}:{i + 2}: the runnable block is never closed")
        blocks.append(Block(path, i + 2, language, "\n".join(body) + "\n", **options))
        i = j + 1
    return blocks


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def collect(root: Path = ROOT) -> list[Block]:
    return [block for path in markdown_files(root) for block in extract(path)]


def _environment(workdir: Path) -> dict:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["HOME"] = env.get("HOME", str(workdir))
    return env


def _prepare(workdir: Path) -> None:
    for name in ("configs", "data"):
        if (ROOT / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    (workdir / ".venv").symlink_to(Path(sys.prefix))


def check_syntax(block: Block) -> str | None:
    """None if the block parses (Python ``compile``, ``bash -n``), else the error."""
    if block.language == "python":
        try:
            compile(block.code, block.where, "exec")
        except SyntaxError as error:
            return f"{type(error).__name__}: {error}"
        return None
    done = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
    return None if done.returncode == 0 else done.stderr.strip()


def run_block(block: Block) -> tuple[bool, str, float]:
    """Runs one block; (passed, output, seconds)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sparta-docs-") as tmp:
        workdir = Path(tmp)
        if block.language == "python":
            script = workdir / "example.py"
            script.write_text(block.code)
            command = [sys.executable, str(script)]
        else:
            _prepare(workdir)
            command = ["bash", "-euo", "pipefail", "-c", block.code]
        try:
            done = subprocess.run(command, cwd=workdir, env=_environment(workdir), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=block.timeout)
        except subprocess.TimeoutExpired as error:
            output = error.stdout if isinstance(error.stdout, str) else (error.stdout or b"").decode(errors="replace")
            return False, f"{output}\n(timed out after {block.timeout} s)", time.monotonic() - start
    passed = done.returncode == block.exit_status
    output = done.stdout
    if not passed:
        output += f"\n(exit status {done.returncode}, expected {block.exit_status})"
    return passed, output, time.monotonic() - start


def _key(block: Block) -> tuple:
    return block.language, block.code, block.exit_status


def _run_once_each(blocks: list[Block], jobs: int) -> dict:
    """``{key: future of run_block}``, one run per distinct block, ``jobs`` at a time (each block is a
    fresh process in its own directory, so they do not see each other)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    runs: dict = {}
    for block in blocks:
        if _key(block) not in runs:
            runs[_key(block)] = pool.submit(run_block, block)
    pool.shutdown(wait=False)
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the runnable blocks and exit")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run the blocks whose FILE:LINE contains TEXT (repeatable)")
    parser.add_argument("--check", action="store_true", help="check the blocks' syntax only")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="blocks run at once (default: 2, or 1 on one core)")
    args = parser.parse_args(argv)
    try:
        blocks = collect()
    except MarkerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.only:
        blocks = [b for b in blocks if any(text in b.where for text in args.only)]
    if args.list:
        for block in blocks:
            print(f"{block.where}  {block.language}  ({len(block.code.splitlines())} lines)")
        return 0
    failures = []
    if args.check:
        for block in blocks:
            problem = check_syntax(block)
            if problem:
                failures.append(block.where)
                print(f"{block.where}: {block.language} block does not parse: {problem}", flush=True)
    else:
        runs = _run_once_each(blocks, args.jobs)  # a block repeated on several pages runs once
        seen = set()
        for block in blocks:
            key = _key(block)
            passed, output, seconds = runs[key].result()
            again = " (the same block as above)" if key in seen else f" ({seconds:.0f} s)"
            seen.add(key)
            print(f"{block.where}: {block.language} ... {'ok' if passed else 'FAILED'}{again}", flush=True)
            if not passed:
                failures.append(block.where)
                print(f"--- {block.where}: output (last {TAIL} characters) ---\n{output[-TAIL:]}\n---", flush=True)
    done = "checked" if args.check else "ran"
    print(f"{done} {len(blocks)} runnable block(s): {len(blocks) - len(failures)} passed"
          + (f", failed: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
