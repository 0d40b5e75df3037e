"""The live widget's Python side: its synced state equals patch_state (whose numbers
test_sink_patching checks against patch_sink + contribution_weights + the logits) for every
control change the front end can make; bad controls become a status message."""

from __future__ import annotations

import json
import re

import pytest

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.interactive.view_state import patch_state
from cw_lens.interactive.widget import SinkPatcher

TEXT = "hello world, attention sinks"


@pytest.fixture()
def widget(llama):
    return cw_lens.sink_patcher(llama, TEXT, layers=(0, 1), scale=0.0)


def expected(model, controls, layer):
    return patch_state(model, TEXT, controls, layer=layer)


def test_initial_state_equals_patch_state(widget, llama):
    assert isinstance(widget, SinkPatcher)
    want = expected(llama, widget.controls, 1)
    assert widget.patched == want["patched"] and widget.data == want["data"]
    assert widget.view == {"layer": 1} and widget.status == ""
    assert widget.controls == {
        "layers": [0, 1],
        "heads": "all",
        "scale": 0.0,
        "mode": "scale",
        "sinks": [0],
    }
    json.dumps(widget.data, allow_nan=False)  # what goes over the wire is plain JSON
    json.dumps(widget.patched, allow_nan=False)


def test_front_end_changes_rerun_the_model(widget, llama):
    # what the front end does: set the synced controls / view
    controls = {"layers": [1, 1], "heads": [0, 2], "scale": 1.5, "mode": "scale", "sinks": [0]}
    before = widget.patched
    widget.controls = controls
    assert widget.status == ""
    assert widget.patched == expected(llama, controls, 1)["patched"] != before
    widget.view = {"layer": 0}
    want = expected(llama, controls, 0)
    assert widget.data == want["data"] and widget.patched == want["patched"]
    assert widget.data["layers"] == [0] and widget.patched["maps"] == [None]  # before the patch
    norm = {**controls, "mode": "norm_matched"}
    widget.controls = norm
    assert widget.patched == expected(llama, norm, 0)["patched"]


def test_sinks_change_recomputes_the_clean_run(widget, llama):
    widget.update(sinks=[0, 4])
    want = expected(llama, {**widget.controls, "sinks": [0, 4]}, 1)
    assert widget.data["clean"] == want["data"]["clean"]  # the clean cone depends on the sinks
    assert widget.patched == want["patched"]


def test_bad_controls_become_a_status_and_keep_the_last_state(widget):
    before = widget.patched
    widget.controls = {**widget.controls, "scale": 3.0}
    assert re.match(r"InputError: scale must lie in \[0, 2\]", widget.status)
    assert widget.patched == before
    widget.controls = {**widget.controls, "scale": 0.5, "heads": [9]}
    assert "out of range" in widget.status
    widget.controls = {**widget.controls, "heads": "all"}
    assert widget.status == "" and widget.patched["controls"]["scale"] == 0.5
    with pytest.raises(InputError, match="Unknown controls"):
        widget.update(lam=0.5)
    with pytest.raises(InputError, match="scale must lie"):
        widget.update(scale=-1)


def test_update_from_python_and_saved_page(widget, llama, tmp_path):
    widget.update(layers=(1, 1), scale=2.0, layer=0)
    assert widget.view == {"layer": 0} and widget.controls["layers"] == [1, 1]
    assert widget.patched == expected(llama, widget.controls, 0)["patched"]
    page = widget.to_html(tmp_path / "w.html", layers=[1])
    assert (tmp_path / "w.html").read_text(encoding="utf-8") == page
    assert "bootPage();" in page and '"free":false' in page


def test_the_widget_front_end_is_the_page_module():
    esm = SinkPatcher._esm
    assert "export default { render }" in esm and "export function bootPage" in esm
    assert ".cw {" in SinkPatcher._css and ":root" not in SinkPatcher._css  # scoped styles
