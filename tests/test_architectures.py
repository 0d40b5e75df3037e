"""The architecture matrix: every decoder family TransformerLens bridges is exact or refused.

Each architecture in ``tests/architectures.py`` is a tiny random HF model wrapped as a bridge.
"exact" ones must match the independent float64 reference read off the HF modules
(``tests/hf_reference.py``) to 1e-5 — intra and inter contribution weights (also on a padded
batch) and the three interventions on logits — and pass ``cw_lens.verify_model``. "refused"
ones must be refused with ``UnsupportedModelError`` naming the architecture — by
``verify_model`` (raised, or a failed report whose ``raise_if_failed`` raises it), by an analysis
and by an intervention: never a raw ``KeyError``, never a number. "unbridged" ones
are those TransformerLens itself cannot wrap; their test fails once it can, so the table is
updated. ``python tests/architecture_table.py`` prints the same matrix as docs/models.md.
"""

from __future__ import annotations

import re

import pytest
import torch
from arch_checks import (
    INTERVENTIONS,
    PADDED_LENGTH,
    built,
    clean_logits_error,
    contribution_error,
    contribution_result,
    intervention_error,
    refusal,
    tokens,
)
from architectures import ARCHS, BY_NAME

import cw_lens

TOL = 1e-5
EXACT = [a.name for a in ARCHS if a.status == "exact"]
REFUSED = [a.name for a in ARCHS if a.status == "refused"]
UNBRIDGED = [a.name for a in ARCHS if a.status == "unbridged"]


# tiny models run several times faster on one thread (no synchronisation per op)
pytestmark = pytest.mark.usefixtures("one_thread")


def bridge(name: str):
    b = built(name)
    assert b.error is None, f"{name}: TransformerLens could not bridge it: {b.error!r}"
    return b.bridge


def test_the_matrix_covers_the_issue():
    """At least 20 architectures, and each status is one of the three."""
    assert len(EXACT) >= 20
    assert {a.status for a in ARCHS} <= {"exact", "refused", "unbridged"}
    assert len({a.name for a in ARCHS}) == len(ARCHS)


# ----------------------------------------------------------------------------- exact
@pytest.mark.parametrize("name", EXACT)
def test_bridge_is_the_hf_model(name):
    """Precondition of the matrix: the bridge's logits are the HF model's."""
    assert clean_logits_error(name) <= TOL


@pytest.mark.parametrize("name", EXACT)
def test_verify_model_passes(name):
    report = cw_lens.verify_model(bridge(name))
    assert report.ok, report.problems
    assert not report.problems
    refused = {k: v for k, v in report.interventions.items() if v.startswith("refused")}
    assert not refused, refused


@pytest.mark.parametrize("kind", ["intra", "inter"])
@pytest.mark.parametrize("name", EXACT)
def test_contribution_weights_match_hf_reference(name, kind):
    assert contribution_error(name, kind) <= TOL


@pytest.mark.parametrize("name", EXACT)
def test_padded_batch_matches_hf_reference(name):
    for kind in ("intra", "inter"):
        assert contribution_error(name, kind, padded=True) <= TOL, kind
    weights = contribution_result(name, "inter", padded=True).weights[1]  # the padded row
    n = weights.shape[-1]
    pad_rows = weights[..., PADDED_LENGTH:, :]  # [layer, head, query >= length, key]
    seen = torch.ones(n, n, dtype=torch.bool).tril()[PADDED_LENGTH:]
    assert bool(pad_rows[..., seen].isnan().all()), "padded query rows must be NaN"


@pytest.mark.parametrize("which", INTERVENTIONS)
@pytest.mark.parametrize("name", EXACT)
def test_intervention_matches_hf_reference(name, which):
    err, effect = intervention_error(name, which)
    assert effect > 1e-2, f"{which} barely changes the logits ({effect:.1e}): the test cannot bite"
    assert err <= TOL, f"{which}: logits differ from the HF reference by {err:.2e}"


# ----------------------------------------------------------------------------- refused
def _why(name: str) -> str:
    return BY_NAME[name].why


@pytest.mark.parametrize("name", REFUSED)
def test_verify_model_refuses(name):
    message = refusal(bridge(name))
    assert message is not None, f"verify_model accepts {name}"
    assert re.search(_why(name), message), message


@pytest.mark.parametrize("name", REFUSED)
def test_analysis_refuses(name):
    with pytest.raises(cw_lens.UnsupportedModelError, match=_why(name)):
        cw_lens.contribution_weights(bridge(name), tokens(), kind="inter")


@pytest.mark.parametrize("which", INTERVENTIONS)
@pytest.mark.parametrize("name", REFUSED)
def test_intervention_refuses(name, which):
    model = bridge(name)
    make = {
        "patch_sink": lambda: cw_lens.patch_sink(model, layers=[0]),
        "mask_attention": lambda: cw_lens.mask_attention(model, {0: torch.zeros((), dtype=bool)}),
        "remove_heads": lambda: cw_lens.remove_heads(model, [(0, 1)]),
    }[which]
    with pytest.raises(cw_lens.UnsupportedModelError, match=_why(name)):
        with make():
            model(tokens())


# ----------------------------------------------------------------------------- unbridged
@pytest.mark.parametrize("name", UNBRIDGED)
def test_transformerlens_cannot_bridge(name):
    """TransformerLens 4.3 fails to wrap these; when it can, move them to exact or refused."""
    error = built(name).error
    assert error is not None, f"{name} bridges now: measure it and update architectures.py"
    assert re.search(_why(name), str(error)), repr(error)
