"""The notebooks run top to bottom on the embedded model (small sizes: CW_LENS_QUICK=1)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("CW_LENS_QUICK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("CW_LENS_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors


def test_the_four_notebooks_exist_and_are_committed_executed():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_patch_sinks.ipynb",
        "03_paper_figures.ipynb",
        "04_live_sink_patching.ipynb",
    ]
    total = 0
    for path in NOTEBOOKS:
        total += path.stat().st_size
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.get("execution_count") for c in code), f"{path.name} is not executed"
        outputs = [o for c in code for o in c.get("outputs", [])]
        assert not [o for o in outputs if o.get("output_type") == "error"], path.name
    # the figures are in the committed notebooks, and the four stay small
    figures = [
        o
        for p in NOTEBOOKS
        for c in nbformat.read(p, as_version=4).cells
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert len(figures) >= 3
    assert total < 6e6, f"{total / 1e6:.1f} MB of notebooks"
