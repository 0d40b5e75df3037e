"""Every docs page runs top to bottom as written.

For each page of `docs/` with a fenced ```` ```python ```` block (found by glob, so a page added
later is checked too) the page's Python blocks run in order, in one fresh Python process per
page, in a temporary working directory (what a page writes lands there), with matplotlib's Agg
backend and `HF_HUB_OFFLINE=1`: a reader who pastes the blocks one after the other into a
script gets what the test gets. Snippets (`--8<-- "README.md:quickstart"`) are expanded as
mkdocs expands them, so a page is run as it is rendered. A failure names the block (page and
line) and shows the traceback, whose frames point at the lines of the Markdown file.

A Python block that is deliberately not run (it needs a GPU, the network or a 7B model) is
preceded by an HTML comment that says why, which mkdocs does not render:

    <!-- no-run: loads a 7B model -->
    ```python
    model = cw_lens.load_model("Qwen/Qwen2-7B-Instruct", device_map="auto")
    ```

Shell commands, output and pseudo-code are fenced as `bash`, `text`, ... instead. The
exceptions are counted and listed (`test_no_run_blocks_are_few_and_say_why`, and `-rA` prints
them per page). Pages that load the embedded SmolLM2 (`load_model()`) are marked `model`; every
page is a fresh process that imports torch and the model stack, so every page is `slow`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EMBEDDED = re.compile(r"load_model\((\)|api=|\"smollm2)")
OPENING = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run\b:?\s*(?P<why>.*?)\s*-->\s*$")
SNIPPET = re.compile(r"^[ \t]*--8<--[ \t]+\"(?P<spec>[^\"]+)\"[ \t]*$")
SECTION = re.compile(r"--8<--\s*\[(?P<edge>start|end):(?P<name>[^\]]+)\]")
PAGE_TIMEOUT_S = 900  # as a notebook cell (test_notebooks.py): a busy machine is slow


@dataclass(frozen=True)
class Block:
    file: Path  # the page, or the file a snippet includes
    line: int  # line number of the block's first code line in `file`
    code: str
    no_run: str | None  # why it is not run; None: it runs

    @property
    def where(self) -> str:
        path = self.file.relative_to(ROOT) if ROOT in self.file.parents else self.file.name
        return f"{path}:{self.line}"


def _lines(spec: str) -> tuple[Path, list[tuple[int, str]]]:
    """The lines (numbered) of a `--8<--` snippet: a whole file or its `[start:name]` section."""
    name = None
    if ":" in spec and not Path(ROOT / spec).exists():
        spec, name = spec.rsplit(":", 1)
    path = ROOT / spec
    numbered = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
    if name is None:
        return path, [(n, line) for n, line in numbered if not SECTION.search(line)]
    inside, out = False, []
    for n, line in numbered:
        edge = SECTION.search(line)
        if edge and edge["name"] == name:
            inside = edge["edge"] == "start"
        elif inside and not edge:
            out.append((n, line))
    assert out, f"no section {name!r} in {path}"
    return path, out


def _expand(page: Path) -> list[tuple[Path, int, str]]:
    """The lines of `page` as mkdocs renders them (snippets included), each with its file and
    line number."""
    out: list[tuple[Path, int, str]] = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        snippet = SNIPPET.match(line)
        if snippet is None:
            out.append((page, n, line))
        else:
            source, lines = _lines(snippet["spec"])
            out.extend((source, m, text) for m, text in lines)
    return out


def python_blocks(page: Path) -> list[Block]:
    """The fenced Python blocks of `page` in reading order (snippets expanded)."""
    lines = _expand(page)
    blocks, i = [], 0
    while i < len(lines):
        path, n, line = lines[i]
        opening = OPENING.match(line)
        if opening is None:
            i += 1
            continue
        fence, indent, start = opening["fence"], opening["indent"], i
        language = opening["info"].strip("{} ").split(" ")[0].lstrip(".").lower()
        body, i = [], i + 1
        while i < len(lines):
            text = lines[i][2].strip()
            if len(text) >= len(fence) and set(text) == {fence[0]}:
                break  # the closing fence
            text = lines[i][2]
            body.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
            i += 1
        i += 1
        if language not in ("python", "py"):
            continue
        before = next((t for _, _, t in reversed(lines[:start]) if t.strip()), "")
        marker = NO_RUN.match(before)
        why = (marker["why"] or "(no reason given)") if marker else None
        blocks.append(Block(path, n + 1, textwrap.dedent("\n".join(body)) + "\n", why))
    return blocks


def _pages() -> list[Path]:
    pages = [p for p in sorted(DOCS.rglob("*.md")) if not any(q.is_symlink() for q in _dirs(p))]
    return [p for p in pages if python_blocks(p)]


def _dirs(page: Path) -> list[Path]:
    return [page.parent, *[d for d in page.parent.parents if DOCS in d.parents]]


PAGES = _pages()

# The driver: runs the blocks of one page in one namespace, each compiled with the page's path
# and its own line numbers (a traceback shows the Markdown line), and names the one that fails.
DRIVER = """
import json, sys, time, traceback
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__"}
for i, block in enumerate(blocks, 1):
    code = "\\n" * (block["line"] - 1) + block["code"]
    start = time.perf_counter()
    try:
        exec(compile(code, block["file"], "exec"), namespace)
    except BaseException:
        print(f"\\nblock {i} of {len(blocks)} failed: {block['where']}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    plt.close("all")
    print(f"block {i} ({block['where']}): {time.perf_counter() - start:.1f} s", flush=True)
print(f"{len(blocks)} blocks ran")
"""


def run_page(page: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run the runnable Python blocks of `page` in a fresh process in `cwd`."""
    blocks = [b for b in python_blocks(page) if b.no_run is None]
    spec = [{"file": str(b.file), "line": b.line, "code": b.code, "where": b.where} for b in blocks]
    (cwd / "blocks.json").write_text(json.dumps(spec), encoding="utf-8")
    (cwd / "driver.py").write_text(DRIVER, encoding="utf-8")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "Agg",
    }
    return subprocess.run(
        [sys.executable, "driver.py", "blocks.json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )


# Pages whose blocks do not run yet, and why. Strict: once a page runs (its blocks fixed, or
# marked no-run where they need a GPU, the network or a 7B model), its entry must go.
NOT_YET_RUNNABLE: dict[str, str] = {}  # page -> why it cannot run yet (none today)


def _params():
    for page in PAGES:
        name = str(page.relative_to(DOCS))
        code = "".join(b.code for b in python_blocks(page) if b.no_run is None)
        marks = [pytest.mark.slow]
        if EMBEDDED.search(code):
            marks.append(pytest.mark.model)
        if name in NOT_YET_RUNNABLE:
            marks.append(pytest.mark.xfail(reason=NOT_YET_RUNNABLE[name], strict=True))
        yield pytest.param(page, marks=marks, id=name)


@pytest.mark.parametrize("page", list(_params()))
def test_page_runs_top_to_bottom(page, tmp_path):
    blocks = python_blocks(page)
    skipped = [b for b in blocks if b.no_run is not None]
    for block in skipped:
        print(f"not run: {block.where}: {block.no_run}")
    name = page.relative_to(ROOT)
    try:
        result = run_page(page, tmp_path)
    except subprocess.TimeoutExpired as timeout:
        done = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else timeout.stdout
        pytest.fail(f"{name}: over {PAGE_TIMEOUT_S} s; blocks done:\n{done or ''}", pytrace=False)
    print(result.stdout)  # the time each block took (shown with -rP)
    if result.returncode != 0:
        pytest.fail(
            f"{name}: a Python block failed (exit {result.returncode})\n{result.stderr[-6000:]}",
            pytrace=False,
        )
    ran = len(blocks) - len(skipped)
    assert result.stdout.rstrip().endswith(f"{ran} blocks ran"), result.stdout[-2000:]


def test_pages_are_found_and_guides_are_among_them():
    names = {str(p.relative_to(DOCS)) for p in PAGES}
    assert "getting-started.md" in names
    assert set(NOT_YET_RUNNABLE) <= names, "an entry of NOT_YET_RUNNABLE names no page"
    assert not any(name.startswith("guides/") for name in NOT_YET_RUNNABLE)
    guides = {f"guides/{p.name}" for p in (DOCS / "guides").glob("*.md") if python_blocks(p)}
    assert len(guides) >= 8
    assert guides <= names


def test_no_run_blocks_are_few_and_say_why():
    skipped = [b for p in PAGES for b in python_blocks(p) if b.no_run is not None]
    total = sum(len(python_blocks(p)) for p in PAGES)
    print(f"{len(skipped)} of {total} Python blocks are not run:")
    for block in skipped:
        print(f"  {block.where}: {block.no_run}")
    assert all(b.no_run != "(no reason given)" for b in skipped), [b.where for b in skipped]
    assert len(skipped) <= max(3, total // 5), [b.where for b in skipped]


def test_a_failing_block_is_named_with_its_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n```python\n"
        "raise SystemExit('not run')\n```\n\nText.\n\n```python\nassert x == 2, 'x is 1'\n```\n",
        encoding="utf-8",
    )
    blocks = python_blocks(page)
    assert [(b.line, b.no_run) for b in blocks] == [(4, None), (9, "needs a GPU"), (15, None)]
    result = run_page(page, tmp_path)
    assert result.returncode == 1
    assert "block 2 of 2 failed: page.md:15" in result.stderr
    assert f'File "{page}", line 15' in result.stderr
    assert "AssertionError: x is 1" in result.stderr
