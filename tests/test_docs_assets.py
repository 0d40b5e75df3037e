"""The docs' vendored assets and shared snippets, checked without building the site (fast)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KATEX = ROOT / "docs" / "assets" / "katex"


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_katex_is_vendored_and_the_site_loads_it():
    """The formulas render from file:// with no network: KaTeX (script, auto-render, CSS, every
    font its CSS names, the licence) lies in docs/assets/katex/, mkdocs.yml loads it and the
    init script, and pymdownx.arithmatex writes the generic markup the init script renders."""
    for name in ("katex.min.js", "katex.min.css", "contrib/auto-render.min.js", "LICENSE"):
        assert (KATEX / name).is_file(), name
    assert "MIT" in (KATEX / "LICENSE").read_text(encoding="utf-8")
    css = (KATEX / "katex.min.css").read_text(encoding="utf-8")
    fonts = {part.split(")")[0] for part in css.split("url(")[1:]}
    assert fonts and all((KATEX / font).is_file() for font in fonts), sorted(fonts)[:3]
    config = _mkdocs()
    scripts = config["extra_javascript"]
    assert scripts == [
        "assets/katex/katex.min.js",
        "assets/katex/contrib/auto-render.min.js",
        "javascripts/katex-init.js",
    ]  # KaTeX before the script that calls it
    assert "assets/katex/katex.min.css" in config["extra_css"]
    assert all((ROOT / "docs" / path).is_file() for path in scripts + config["extra_css"])
    init = (ROOT / "docs" / "javascripts" / "katex-init.js").read_text(encoding="utf-8")
    assert ".arithmatex" in init and "renderMathInElement" in init
    extensions = [e for e in config["markdown_extensions"] if isinstance(e, dict)]
    arithmatex = [e["pymdownx.arithmatex"] for e in extensions if "pymdownx.arithmatex" in e]
    assert arithmatex == [{"generic": True}]
    assert "https://" not in init and "cdn" not in " ".join(scripts)


def test_methods_page_writes_its_formulas_in_one_notation():
    """docs/methods.md: LaTeX formulas, α and ‖·‖ as \\alpha and \\lVert…\\rVert, no ASCII
    `alpha[i,j]` / `||x||` left from the old plain-text notation."""
    text = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    assert text.count("$$") >= 10 and "\\lVert" in text and "\\alpha_{ij}^h" in text
    for old in ("alpha[i,j]", "||pv", "||o_", "‖pv", "α₀"):
        assert old not in text, old


def test_the_docs_show_the_readme_quickstart_that_make_package_runs():
    """getting-started includes the README's Quickstart block (pymdownx.snippets section), and
    tests/check_installed_package.py extracts the same block, which parses."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "--8<-- [start:quickstart]" in readme and "--8<-- [end:quickstart]" in readme
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert '--8<-- "README.md:quickstart"' in page
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from check_installed_package import quickstart_code
    finally:
        sys.path.remove(str(ROOT / "tests"))
    code = quickstart_code(readme)
    section = readme.split("--8<-- [start:quickstart]")[1].split("--8<-- [end:quickstart]")[0]
    assert code in section and "cw_lens.load_model()" in code
    ast.parse(code)


def test_the_package_description_works_off_the_repository():
    """The description the package index shows (pyproject's `readme`) links nowhere into the
    repository — no relative link or image, since an index page has no repository beside it —
    the project declares no URL that is not absolute, and its Quickstart, which `make package`
    runs from the installed wheel's metadata, is the README's, character for character."""
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    description = (ROOT / project["readme"]).read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)]+)\)", description) + re.findall(r'src="([^"]+)"', description)
    assert all(t.startswith("https://") for t in targets), targets
    assert all(url.startswith("https://") for url in project.get("urls", {}).values())
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from check_installed_package import quickstart_code
    finally:
        sys.path.remove(str(ROOT / "tests"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert quickstart_code(description) == quickstart_code(readme)


def _paragraph(text: str, marker: str) -> str:
    """The first paragraph (blank-line separated) of `text` holding `marker`, whitespace
    collapsed."""
    import re

    for block in re.split(r"\n\s*\n", text):
        flat = " ".join(block.split())
        if marker in flat:
            return flat
    raise AssertionError(f"no paragraph says {marker!r}")


def test_the_pages_name_the_checks_the_certificate_leaves_undecided():
    """README, the docs' home page and the coverage page name the same checks a quick run (8
    documents) cannot settle, and they are the ones the code's certificate
    (`interval_coverage.not_certified_because`) leaves undecided at 8 documents among the main
    job's checks (figures/summary.json); at the paper preset's counts every check is certified;
    the coverage page's "Certified from" list is `certified_from`'s."""
    import json
    import re

    from cw_lens.reproduction.interval_coverage import _rows, certified_from, not_certified_because

    summary = json.loads((ROOT / "figures" / "summary.json").read_text(encoding="utf-8"))
    checks = [
        (cid, c["number"])
        for cid, claim in summary["claims"].items()
        for c in claim["checks"]
        if c["interval"] is not None
    ]
    numbers = {number for _, number in checks}
    at_8 = {number for number in numbers if not_certified_because(number, 8) is not None}
    word = {4: "four", 5: "five", 6: "six", 7: "seven"}[len(at_8)]
    for page in ("README.md", "docs/index.md", "docs/coverage.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        paragraph = _paragraph(text, "not certified at 8 documents")
        named = set(re.findall(r"`([A-Za-z0-9_.]+)`", paragraph)) & numbers
        assert named == at_8, (page, sorted(named ^ at_8))
        assert f"{word} checks are not certified at 8 documents" in paragraph, page
    causal = {
        cid: part["n_documents"]
        for cid, part in (
            ("faithfulness_order", summary["causal_sample"]["faithfulness"]),
            ("pruning_signal", summary["causal_sample"]["pruning"]),
        )
    }
    paper = {
        number
        for cid, number in checks
        if not_certified_because(number, causal.get(cid, summary["n_documents"])) is not None
    }
    assert paper == set()
    coverage = (ROOT / "docs" / "coverage.md").read_text(encoding="utf-8")
    opening = _paragraph(coverage, "not certified at 8 documents")
    assert "At the `paper` preset's counts every number is certified;" in opening
    listed = _paragraph(coverage, "**Certified from**")
    stated = dict(re.findall(r"`([a-z0-9_.]+)` (\d+|never)", listed))
    studied = {n for n in _rows() if n in numbers and not n.startswith("median_abs_rho_")}
    studied -= {n for cid, n in checks if cid in causal}
    assert set(stated) == studied
    for number, count in stated.items():
        assert certified_from(number) == (None if count == "never" else int(count)), number


def test_the_statistics_pages_typeset_their_formulas():
    """docs/coverage.md and docs/reproducing.md write formulas as math (pymdownx.arithmatex, as
    docs/methods.md), not as code spans: no `Phi(sqrt(...))`, `t_{q, k}`, `p <= q` or `t*`."""
    import re

    for page in ("coverage.md", "reproducing.md"):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        assert "$$" in text, page
        spans = re.findall(r"`([^`\n]+)`", text)
        formulas = [s for s in spans if re.search(r"sqrt|Phi|_\{|<=|>=|t\*|\bmean\(| ~ ", s)]
        assert not formulas, (page, formulas)


def test_the_readme_is_short_enough_to_read_to_the_end():
    """README.md is at most 200 lines: what cw_lens does, the headline figure, install, the
    Quickstart, the analyses, the two commands, the claims, citing and the licence; the detail
    lives on the docs pages it links, the history in CHANGELOG.md."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"


def _table_cells(line: str) -> int:
    """How many cells a Markdown table row has: `|` splits outside code spans, `\\|` does not."""
    line = line.strip()
    line = line[1:] if line.startswith("|") else line
    line = line[:-1] if line.endswith("|") and not line.endswith("\\|") else line
    cells, in_code, i = 1, False, 0
    while i < len(line):
        if line[i] == "\\":
            i += 2
            continue
        if line[i] == "`":
            in_code = not in_code
        elif line[i] == "|" and not in_code:
            cells += 1
        i += 1
    return cells


def test_every_table_row_has_as_many_cells_as_its_header():
    """Python-Markdown drops a row's cells beyond its header's silently (the models page lost
    a wall time that way, and a test count showed under "wall time"): every row of every table
    in the README and the docs' pages has its header's cell count."""
    import re

    separator = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    wrong = []
    for page in pages:
        if not page.is_file() or "figures" in page.relative_to(ROOT).parts:
            continue
        lines = page.read_text(encoding="utf-8").splitlines()
        fenced = False
        for n, line in enumerate(lines[:-1]):
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            if fenced or "|" not in line or not separator.match(lines[n + 1]):
                continue
            width = _table_cells(line)
            for m in range(n + 2, len(lines)):
                if not lines[m].strip().startswith("|"):
                    break
                if _table_cells(lines[m]) != width:
                    wrong.append(f"{page.relative_to(ROOT)}:{m + 1}: {width} columns")
    assert not wrong, wrong
