"""`make docs` fails on a broken link: the strict build of the site (docs/build_site.sh, the one
command line of `make docs`) run on a copy of the docs in which one page has broken links, one
of each kind. The build of the real docs is `make docs` itself (part of `make test`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "build_site.sh"
PAGE = "guides/sinks.md"  # the page broken here: it links the methods page twice, with anchors


def test_make_docs_runs_the_build_script():
    """The Makefile builds the docs only through docs/build_site.sh (what the test below runs),
    which keeps mkdocs's warnings (no --quiet) and its exit status (pipefail)."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "no docs target in the Makefile"
    assert "bash docs/build_site.sh" in recipe.group(1)
    commands = [line for line in makefile.splitlines() if line.startswith("\t")]
    assert not any("mkdocs build" in line for line in commands)  # no second command line
    code = [line for line in SCRIPT.read_text(encoding="utf-8").splitlines() if line[:1] != "#"]
    script = "\n".join(code)
    assert "set -euo pipefail" in script and "--strict" in script and "--quiet" not in script
    assert "build_site.sh" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")  # not a page


def _copy_of_the_docs(root: Path) -> Path:
    """The checkout as mkdocs sees it, under `root`: docs/ and mkdocs.yml copied (docs/'s links
    to ../notebooks and ../figures kept), everything else a link to the checkout's own."""
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {"docs", "site", "mkdocs.yml"} and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", root / "docs", symlinks=True)
    shutil.copy2(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="docs/build_site.sh needs bash")
def test_the_docs_build_fails_on_a_broken_link_and_names_it(tmp_path):
    """One page with a link to a page that does not exist, a link to an anchor that does not
    exist and an API reference to a name that does not exist: the build fails, and its output
    names each of the three and nothing else (the rest of the docs builds without a warning)."""
    root = _copy_of_the_docs(tmp_path / "checkout")
    page = root / "docs" / PAGE
    text = page.read_text(encoding="utf-8")
    links = re.findall(r"\]\((\.\./methods\.md)#([\w-]+)\)", text)
    assert len(links) >= 2, f"{PAGE} no longer links the methods page twice: pick another page"
    (target, first), (_, second) = links[:2]
    text = text.replace(f"]({target}#{first})", f"](../no-such-page.md#{first})", 1)
    text = text.replace(f"]({target}#{second})", f"]({target}#no-such-anchor)", 1)
    text += "\nSee also [`sink_statistics`][cw_lens.no_such_function].\n"
    page.write_text(text, encoding="utf-8")

    mkdocs = Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "MKDOCS": str(mkdocs if mkdocs.exists() else "mkdocs")}
    out = subprocess.run(
        ["bash", str(SCRIPT), "mkdocs.yml", str(tmp_path / "site")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = out.stdout + out.stderr
    assert out.returncode != 0, log
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 3, log
    assert any(PAGE in w and "../no-such-page.md" in w for w in warnings), log
    assert any(PAGE in w and "#no-such-anchor" in w for w in warnings), log
    assert any("cw_lens.no_such_function" in w for w in warnings), log
    assert "Aborted with 3 warnings in strict mode" in log, log
    assert not any(line.startswith("INFO") for line in log.splitlines()), log
    assert "no warnings" not in log, log


class _LinksAndAnchors(HTMLParser):
    """The ids (and `name`s) a built page defines and the hrefs it links to."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.ids.update(v for k in ("id", "name") if (v := found.get(k)))
        if tag in ("a", "link") and found.get("href") is not None:
            self.hrefs.append(found["href"])


def broken_links(site: Path) -> list[str]:
    """Every local href of the built site that does not resolve: a page or file that is not
    there, or an anchor its page does not define. External links (a scheme or a host) are not
    followed; 404.html is left out (its links are absolute, from the site's root on a server)."""
    pages = {}
    for path in sorted(site.rglob("*.html")):
        page = _LinksAndAnchors()
        page.feed(path.read_text(encoding="utf-8", errors="replace"))
        pages[path.resolve()] = page
    broken = []
    for path, page in pages.items():
        if path.name == "404.html" and path.parent == site.resolve():
            continue
        for href in page.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc:
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site.resolve())}: {href}"
            if not target.exists():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in pages[target].ids:
                    broken.append(f"{where} (no such anchor)")
    return broken


@pytest.mark.slow
def test_every_link_of_the_built_site_resolves(tmp_path):
    """The real docs, built (the strict build's own checks are `make docs`'s): every href to a
    local page, file or anchor in the HTML resolves — including what mkdocs does not check, such
    as links to files the site leaves out and the table of contents mkdocs-jupyter writes for a
    notebook. The checker itself finds a missing page and a missing anchor."""
    site = tmp_path / "site"
    mkdocs = Path(sys.executable).with_name("mkdocs")
    build = ["build", "--no-strict", "--quiet", "--config-file", "mkdocs.yml"]
    out = subprocess.run(
        [str(mkdocs if mkdocs.exists() else "mkdocs"), *build, "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (site / "index.html").is_file() and (site / "models.html").is_file()
    assert broken_links(site) == []
    (site / "extra.html").write_text(
        '<a href="models.html#no-such-anchor">x</a><a href="no-such-page.html">y</a>'
        '<a href="https://example.org/x#y">z</a><a href="models.html#verification">v</a>',
        encoding="utf-8",
    )
    assert broken_links(site) == [
        "extra.html: models.html#no-such-anchor (no such anchor)",
        "extra.html: no-such-page.html (no such file)",
    ]
