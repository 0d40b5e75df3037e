"""Check an installed cw_lens wheel the way a newcomer uses it (``make package``).

Run with the Python of a fresh virtual environment that has torch, the built wheel and the
model wheel, from a folder outside the checkout (so that the checkout cannot be imported)::

    python check_installed_package.py OUT_DIR

It checks that cw_lens is imported from site-packages, that the package data is there (the
token view's template, CSS and JS, the route panel, the interval-coverage table), runs the
README's Quickstart — read from the installed package's own metadata, which is the README the
wheel was built from, so the two cannot drift — and builds the saved pages: the token view
(``python -m cw_lens.viz``), the sink-patching page and the route panel, each from disk with
no network. Not collected by pytest (its name does not start with ``test_``).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from importlib import metadata, resources
from pathlib import Path

PACKAGE_DATA = {
    "cw_lens.viz": ("template.html", "view.css", "view.js", "routes.html", "routes.js"),
    "cw_lens.reproduction": ("interval_coverage.json",),
}


def quickstart_code(readme: str) -> str:
    """The first ``python`` block after the README's ``## Quickstart`` heading."""
    section = readme.split("\n## Quickstart", 1)
    if len(section) != 2:
        raise SystemExit("the README has no '## Quickstart' section")
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    if block is None:
        raise SystemExit("the README's Quickstart has no python block")
    return block.group(1)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    import cw_lens

    where = Path(cw_lens.__file__).resolve()
    if "site-packages" not in where.parts:
        raise SystemExit(f"cw_lens was imported from {where}, not from an installed wheel")
    print(f"[package] cw_lens {cw_lens.__version__} from {where.parent}")

    for package, names in PACKAGE_DATA.items():
        folder = resources.files(package)
        missing = [n for n in names if not folder.joinpath(n).is_file()]
        if missing:
            raise SystemExit(f"package data missing from {package}: {missing}")
    from cw_lens.reproduction.interval_coverage import measured

    assert measured(), "the interval-coverage table is empty"
    print("[package] package data present: " + ", ".join(sum(PACKAGE_DATA.values(), ())))

    # the README's Quickstart, as the wheel's metadata carries it
    # (statement by statement, so that the slow ones are named with their wall time)
    code = quickstart_code(metadata.metadata("cw_lens")["Description"])
    namespace: dict = {}
    for statement in ast.parse(code).body:
        begin = time.perf_counter()
        module = ast.Module(body=[statement], type_ignores=[])
        exec(compile(module, "README.md#quickstart", "exec"), namespace)
        took = time.perf_counter() - begin
        if took > 1.0:
            print(f"[package]   {took:5.1f} s  {ast.unparse(statement)[:70]}")
    heads = namespace["stats"].heads()
    assert len(namespace["cw"].top(k=5, sum_heads=True)) == 5 and len(heads) > 0
    print(f"[package] README Quickstart ran ({time.perf_counter() - start:.1f} s with import)")

    # the saved pages: self-contained, the package's JS and CSS inlined
    view = out / "view.html"
    subprocess.run([sys.executable, "-m", "cw_lens.viz", str(view)], check=True)
    js = resources.files("cw_lens.viz").joinpath("view.js").read_text(encoding="utf-8")
    page = view.read_text(encoding="utf-8")
    assert js.strip()[:200] in page, "the token view page does not inline view.js"
    from cw_lens.interactive.view_state import sink_patch_html
    from cw_lens.models.testing import tiny_llama

    tiny = tiny_llama()
    sink_page = sink_patch_html(tiny, "hello world", path=out / "sink.html", scales=(0.0, 1.0))
    assert js.strip()[:200] in sink_page and "{{" not in sink_page
    routes_page = cw_lens.routes(tiny, "hello world").to_html(out / "routes.html")
    assert 'id="route-data"' in routes_page
    print(f"[package] saved pages written: {view.name}, sink.html, routes.html in {out}")
    subprocess.run(
        [str(Path(sys.executable).with_name("cw-lens")), "--help"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    took = time.perf_counter() - start
    print(f"[package] cw-lens --help runs; all checks passed in {took:.1f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "package-check"))
