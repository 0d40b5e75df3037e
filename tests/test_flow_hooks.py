"""No silent zeros: a hook point that a model lists but never runs is refused, never a result.

OpenAI-GPT's bridge lists ``blocks.{l}.hook_resid_post`` but never fires it: the flow analyses
must refuse it (and ``verify_model`` say so) while its contribution weights stay exact. A hook
planted silent on a verified tiny Llama proves that every streaming path checks, after the
pass, that each requested layer was delivered (the verification is cached, so only the
path's own check stands between the silent hook and a result of zeros).
"""

from __future__ import annotations

import pytest
from apis import needs_bridge

import cw_lens
from cw_lens.core.errors import UnsupportedModelError
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.access import model_access
from cw_lens.models.blocks import run_blocks
from cw_lens.models.testing import random_tokens

SILENT_POST = r"layer 1: the hook blocks\.1\.hook_resid_post never fired"
SILENT_Z = r"layer 1: the hook blocks\.1\.attn\.hook_z never fired"


@needs_bridge
def test_openai_gpt_flow_is_refused_naming_the_silent_hook():
    from arch_checks import built

    model = built("OpenAI-GPT").bridge
    report = cw_lens.verify_model(model)
    assert report.ok  # contribution weights are exact on it
    assert report.flow.startswith("refused") and "hook_resid_post never fired" in report.flow
    tokens = random_tokens(model, 1, 7)
    message = r"layer 0: the hook blocks\.0\.hook_resid_post never fired"
    calls = []
    for run in (
        lambda: cw_lens.stream_shares(model, tokens, calls.append),
        lambda: cw_lens.residual_shares(model, tokens),
        lambda: cw_lens.contribution_rollout(model, tokens),
        lambda: cw_lens.routes(model, tokens),
    ):
        with pytest.raises(UnsupportedModelError, match=message):
            run()
    assert not calls
    # the runtime check alone (no verification in front of run_blocks)
    with pytest.raises(UnsupportedModelError, match=message):
        run_blocks(model, prepare_inputs(model, tokens), calls.append, layers=[0, 1])
    assert not calls


@pytest.fixture
def silence(llama, monkeypatch):
    """``silence(name)``: the hook point ``name`` of the (verified) tiny Llama stops running
    the hooks added to it; undone after the test."""
    assert cw_lens.verify_model(llama).ok  # cached: the paths below are not re-verified
    assert cw_lens.verify_model(llama).flow.startswith("exact")
    access = model_access(llama)

    def apply(name: str) -> None:
        mute(monkeypatch, llama.hook_dict[access._aliases.get(name, name)])

    return apply


def mute(monkeypatch, point) -> None:
    """Hooks added to ``point`` are registered but never run (a hook that never fires)."""
    add = point.add_hook
    monkeypatch.setattr(point, "add_hook", lambda fn, *a, **kw: add(lambda t, hook: None, *a, **kw))


def _consume(_):
    return None


TEXTS = ["a short text for the silent hook test", "another one"]

ATTENTION_PATHS = {
    "stream_contributions": lambda m: cw_lens.stream_contributions(m, TEXTS, _consume),
    "contribution_weights": lambda m: cw_lens.contribution_weights(m, TEXTS),
    "sink_statistics": lambda m: cw_lens.sink_statistics(m, TEXTS, min_query=2),
    "selection_geometry": lambda m: cw_lens.selection_geometry(m, TEXTS, progress=False),
    "attention_rollout": lambda m: cw_lens.attention_rollout(m, TEXTS),
}
FLOW_PATHS = {
    "stream_shares": lambda m: cw_lens.stream_shares(m, TEXTS, _consume),
    "residual_shares": lambda m: cw_lens.residual_shares(m, TEXTS),
    "contribution_rollout": lambda m: cw_lens.contribution_rollout(m, TEXTS),
    "routes": lambda m: cw_lens.routes(m, TEXTS[0]),
    "run_blocks": lambda m: run_blocks(m, prepare_inputs(m, TEXTS), _consume, layers=[0, 1]),
}


@pytest.mark.parametrize("path", list(ATTENTION_PATHS) + list(FLOW_PATHS))
def test_every_streaming_path_refuses_a_silent_attention_hook(llama, silence, path):
    silence("blocks.1.attn.hook_z")
    with pytest.raises(UnsupportedModelError, match=SILENT_Z):
        {**ATTENTION_PATHS, **FLOW_PATHS}[path](llama)


@pytest.mark.parametrize("path", list(FLOW_PATHS))
def test_every_flow_path_refuses_a_silent_residual_hook(llama, silence, path):
    silence("blocks.1.hook_resid_post")
    with pytest.raises(UnsupportedModelError, match=SILENT_POST):
        FLOW_PATHS[path](llama)


@pytest.mark.parametrize("kind", ["resid_pre", "resid_mid", "attn_out", "mlp_out"])
def test_a_silent_piece_of_a_block_is_named(llama, silence, kind):
    silence(f"blocks.0.hook_{kind}")
    with pytest.raises(UnsupportedModelError, match=rf"layer 0: the hook blocks\.0\.hook_{kind} "):
        cw_lens.residual_shares(llama, TEXTS)


def test_verify_model_reports_the_flow_hooks(llama, monkeypatch):
    """A model whose resid_post never fires: verified for contribution weights, flow refused."""
    report = cw_lens.verify_model(llama)
    assert report.flow == "exact (sequential blocks)"
    assert "flow analyses: exact" in report.summary_text()
    name = "blocks.0.hook_resid_post"
    mute(monkeypatch, llama.hook_dict[model_access(llama)._aliases.get(name, name)])
    fresh = cw_lens.verify_model(llama, force=True)
    try:
        assert fresh.ok and fresh.flow.startswith("refused")
        assert "blocks.0.hook_resid_post never fired" in fresh.flow
        with pytest.raises(UnsupportedModelError, match=r"flow analyses .* cannot run"):
            cw_lens.residual_shares(llama, "hello")
    finally:
        monkeypatch.undo()
        assert cw_lens.verify_model(llama, force=True).flow.startswith("exact")
