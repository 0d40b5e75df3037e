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
