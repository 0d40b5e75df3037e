"""The widget's patched pass, resumed at the first patched layer from the clean run's residual
stream (`cw_lens.interactive.resume`), is bit-equal to the full patched pass: the logits, the
residual stream at every hook point from block L on (`blocks.L.hook_resid_pre` first), and every
number the widget shows (top-k, NLL, contribution weights and their factors, cone measures, the
JSON payload) compared with `torch.equal` on the bits. Where resuming cannot be vouched for,
the full pass runs and says why. The comparison has the power to see a pass that starts one
layer late or reads a stream one ulp off (tested too)."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from functools import cache

import pytest
import torch
from apis import APIS, needs_bridge

import cw_lens
from cw_lens.data.inputs import prepare_inputs
from cw_lens.interactive import resume
from cw_lens.interactive.comparison import PatchControls, SinkRun, run_text
from cw_lens.interactive.resume import CleanStream, ResumePlan
from cw_lens.interactive.view_state import clean_run, patch_state, sink_patch_data
from cw_lens.models.access import hook_name
from cw_lens.models.testing import tiny_gpt2, tiny_llama
from cw_lens.viz.payload import patched_payload

TEXT = "hello world, attention sinks"
PROSE = "The capital of France is Paris. The capital of Germany is"
RESULT_FIELDS = ("attention", "cosine", "projected_value_norm", "output_norm", "head_output_norm")
DERIVED = ("weights", "relative_norm", "value_norm", "value_norm_output")


@cache
def deep(arch: str, api: str):
    """A 4-layer tiny model (so the patch can start at 0, in the middle and at the last)."""
    return {"llama": tiny_llama, "gpt2": tiny_gpt2}[arch](seed=1, n_layers=4, api=api)


@pytest.fixture(scope="module")
def own_llama():
    """The tiny Llama of the `llama` fixture, this module's own: a resumed pass refuses a model
    carrying hooks it did not place, and other tests may leave some on the session's shared
    model."""
    from cw_lens.models.hooked import resolve_api

    return tiny_llama(seed=0, api=resolve_api("auto"))


@pytest.fixture(scope="module")
def own_smollm():
    """The embedded model, this module's own (as `own_llama`)."""
    return cw_lens.load_model(device="cpu")


@pytest.fixture(scope="module")
def own_smollm_hooked():
    """The embedded model as a HookedTransformer, this module's own (as `own_llama`)."""
    from apis import HAS_BRIDGE, needs_hooked

    if needs_hooked.args[0]:
        pytest.skip(needs_hooked.kwargs["reason"])
    return cw_lens.load_model(device="cpu", api="hooked" if HAS_BRIDGE else "auto")


@cache
def recorded(model, text: str, sinks: tuple[int, ...] = (0,)) -> tuple[SinkRun, CleanStream]:
    stream = CleanStream()
    return clean_run(model, text, sinks=sinks, stream=stream), stream


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (NaN included: floats are compared as their integer bit patterns)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    return torch.equal(a, b)


def assert_same_run(full: SinkRun, resumed: SinkRun) -> None:
    for name in ("top_ids", "top_probs", "nll", "norm", "cone"):
        assert same_bits(getattr(full, name), getattr(resumed, name)), name
    assert full.cone_layers == resumed.cone_layers and full.sinks == resumed.sinks
    fw, rw = full.weights, resumed.weights
    assert fw.layers == rw.layers and fw.heads == rw.heads and fw.n_nan_rows == rw.n_nan_rows
    for name in RESULT_FIELDS + DERIVED:
        assert same_bits(getattr(fw, name), getattr(rw, name)), name


def raw_pass(model, tokens, controls: PatchControls, plan: ResumePlan | None = None) -> dict:
    """Logits and the residual stream at every block's hooks from the first patched layer on
    (those that fired), under the patch, resumed by `plan` (or the full pass)."""
    got: dict[str, torch.Tensor] = {}
    first = controls.layers[0]
    names = [
        hook_name(kind, layer)
        for layer in range(first, model.cfg.n_layers)
        for kind in ("resid_pre", "resid_post")
    ]

    def keep(t, hook, name):
        got[name] = t.clone()

    hooks = [(name, lambda t, hook, name=name: keep(t, hook, name)) for name in names]
    with (
        torch.inference_mode(),
        nullcontext() if plan is None else plan.context(model),
        controls.hooks(model),
        model.hooks(fwd_hooks=hooks),
    ):
        got["logits"] = model(tokens)
    return got


def off_by_one_ulp(stream: CleanStream, block: int) -> CleanStream:
    """A copy of `stream` whose block `block` returned one number one ulp larger."""
    copy = CleanStream()
    copy.__dict__.update(stream.__dict__)
    copy.outputs = list(stream.outputs)
    output = stream.outputs[block]
    tensor = (output if torch.is_tensor(output) else output[0]).clone()
    tensor[0, 3, 5] = torch.nextafter(tensor[0, 3, 5], tensor[0, 3, 5] + 1)
    copy.outputs[block] = tensor if torch.is_tensor(output) else (tensor, *output[1:])
    return copy


def check_resume(model, text: str, layers, view, **patch) -> None:
    """Full and resumed: the comparison runs, the widget state, and the raw pass."""
    clean, stream = recorded(model, text, tuple(patch.get("sink_positions", (0,))))
    assert stream.refusal is None, stream.refusal
    kw = dict(layers=layers, view_layers=view, clean=clean, **patch)
    full = cw_lens.compare_sink_patch(model, text, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "The patched pass runs in full")  # no fallback
        resumed = cw_lens.compare_sink_patch(model, text, stream=stream, **kw)
    first = layers[0]
    said = f"resumed at layer {first}" if first else "full pass: the patch starts at layer 0"
    assert stream.note == said
    assert_same_run(full.clean, resumed.clean)
    assert_same_run(full.patched, resumed.patched)
    controls = full.controls
    for layer in view:
        args = dict(layer=layer, clean=clean)
        want = patch_state(model, text, controls, **args)["patched"]
        assert patch_state(model, text, controls, stream=stream, **args)["patched"] == want
    tokens = prepare_inputs(model, text).tokens
    plan = stream.plan(model, prepare_inputs(model, text), first, view)
    assert plan.first == first
    a, b = raw_pass(model, tokens, controls), raw_pass(model, tokens, controls, plan)
    assert len(a) == 2 * (model.cfg.n_layers - first) + 1 and a.keys() == b.keys()
    for name in a:
        assert same_bits(a[name], b[name]), name


def test_tiny_llama_first_and_last_layer(own_llama):
    """`load_model("testing:tiny-llama")`: the patch from layer 0 (nothing to skip) and from
    the last layer, viewed before, at and after its first layer."""
    llama = own_llama
    check_resume(llama, TEXT, (0, 1), [1])
    check_resume(llama, TEXT, (1, 1), [1])
    check_resume(llama, TEXT, (1, 1), [0])  # the view before the patch: from the clean run
    check_resume(llama, TEXT, (1, 1), [0, 1], heads=[0, 3], scale=1.5)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(
    ("layers", "view", "patch"),
    [
        ((0, 3), [2], {"scale": 0.0}),
        ((2, 2), [2], {"scale": 0.0}),  # the middle
        ((2, 3), [1, 3], {"mode": "norm_matched"}),
        ((1, 2), [3], {"heads": [1], "scale": 2.0}),
        ((3, 3), [3], {"scale": 0.25, "sink_positions": (0, 2)}),  # the last
        ((3, 3), [0, 1], {"scale": 1.0}),
    ],
)
def test_resumed_pass_is_the_full_pass(arch, api, layers, view, patch):
    check_resume(deep(arch, api), TEXT, layers, view, **patch)


# wirings of the architecture matrix (tests/architectures.py): alternating sliding-window and
# global layers with logit soft-capping, parallel blocks, the attention-output route with
# partial rotary, ALiBi, post-norm blocks; OPT's bridge wires hooks into its blocks, so it
# runs the full pass (and says so)
MATRIX = {"Gemma 2": True, "Cohere": True, "GPT-J": True, "MPT": True, "OLMo 2": True,
          "OPT": False}  # fmt: skip


@pytest.mark.slow
@needs_bridge
@pytest.mark.parametrize("name", list(MATRIX))
def test_architectures_resume_exactly_or_run_in_full(name):
    from arch_checks import built

    model = built(name).bridge
    clean, stream = recorded(model, TEXT)
    if MATRIX[name]:
        check_resume(model, TEXT, (1, 1), [1], heads=[0, 3], scale=0.25)
        check_resume(model, TEXT, (1, 1), [0], mode="norm_matched")
    else:
        full_pass_because(model, stream, clean, "hooks sit in the blocks")


def test_the_comparison_sees_a_late_start_and_a_wrong_stream():
    """The checks above have power: a pass that starts one layer too late (the first patched
    layer replayed clean) or reads a stream one ulp off in one number differs from the full
    pass."""
    model = deep("llama", APIS[0])
    _, stream = recorded(model, TEXT)
    controls = PatchControls.of(model, layers=(2, 3), scale=0.0)
    tokens = prepare_inputs(model, TEXT).tokens
    full = raw_pass(model, tokens, controls)
    late = raw_pass(model, tokens, controls, ResumePlan([3], [3], 3, stream))
    assert not same_bits(full["logits"], late["logits"])
    off = raw_pass(model, tokens, controls, ResumePlan([3], [3], 2, off_by_one_ulp(stream, 1)))
    assert not same_bits(full["logits"], off["logits"])


def full_pass_because(model, stream, clean, why: str, text: str = TEXT) -> None:
    """The comparison falls back to the full pass, says why (a warning and the note), and
    gives the full pass's numbers."""
    kw = dict(layers=(1, 1), view_layers=[1], clean=clean)
    full = cw_lens.compare_sink_patch(model, text, **kw)
    with pytest.warns(RuntimeWarning, match="runs in full"):
        fallback = cw_lens.compare_sink_patch(model, text, stream=stream, **kw)
    assert stream.note.startswith("full pass: ") and why in stream.note
    assert_same_run(full.patched, fallback.patched)


def test_what_rules_resuming_out_runs_the_full_pass():
    model = tiny_llama(seed=1, n_layers=4, api=APIS[0])  # its own: its parameters are written
    stream = CleanStream()
    clean = clean_run(model, TEXT, stream=stream)

    def keep(t, hook):
        return None

    with model.hooks(fwd_hooks=[(hook_name("resid_post", 0), keep)]):
        full_pass_because(model, stream, clean, "hooks sit in the blocks")
    with cw_lens.patch_sink(model, layers=[3], scale=0.5):
        full_pass_because(model, stream, clean, "an intervention is entered")
    model.train()
    try:
        full_pass_because(model, stream, clean, "training mode")
    finally:
        model.eval()
    other = "hello world, attention links"  # as many tokens, another text
    full_pass_because(model, stream, clean_run(model, other), "another text", other)
    twin = tiny_llama(seed=2, n_layers=4, api=APIS[0])  # another model: not its stream, nor
    full_pass_because(twin, stream, clean_run(twin, TEXT), "another model")  # its kept W_O
    kw = dict(layers=(0, 1), view_layers=[1], clean=clean_run(twin, TEXT))
    want = cw_lens.compare_sink_patch(twin, TEXT, **kw)
    assert_same_run(
        want.patched, cw_lens.compare_sink_patch(twin, TEXT, stream=stream, **kw).patched
    )
    param = next(model.blocks[0].parameters())
    with torch.no_grad():
        param.add_(0.0)  # a write in place: the stream and the kept weights may be stale
    full_pass_because(model, stream, clean, "parameters changed")
    assert not stream.weights
    clean = clean_run(model, TEXT, stream=stream)  # recorded again: resumes again
    cw_lens.compare_sink_patch(model, TEXT, layers=(1, 1), view_layers=[1], clean=clean,
                               stream=stream)  # fmt: skip
    assert stream.note == "resumed at layer 1"


def test_recording_under_hooks_refuses_and_a_failed_self_check_refuses():
    model = deep("gpt2", APIS[0])
    stream = CleanStream()
    with model.hooks(fwd_hooks=[(hook_name("resid_pre", 2), lambda t, hook: None)]):
        clean = clean_run(model, TEXT, stream=stream)
    assert stream.refusal == "hooks sit in the blocks a resumed pass would skip"
    full_pass_because(model, stream, clean, "hooks sit in the blocks")
    _, stream = recorded(model, TEXT)
    checked = resume._SELF_CHECK.pop(model)  # the verdict of its first stream: None
    try:  # a stream the blocks do not reproduce, as when blocks share state (a shared cache)
        verdict = resume.self_check(model, off_by_one_ulp(stream, 3))
        assert "does not reproduce the clean pass" in verdict
    finally:
        resume._SELF_CHECK[model] = checked
    assert checked is None


def test_saved_page_sweep_resumes_exactly():
    """The saved page's sweep resumes its patched passes too: every run equals the full pass's
    payload (views before, inside and after the ranges)."""
    model = deep("llama", APIS[0])
    ranges, view = [(0, 1), (2, 3), (1, 3)], [1, 3]
    data = sink_patch_data(model, TEXT, layers=view, ranges=ranges, scales=(0.0, 0.5))
    batch = prepare_inputs(model, TEXT)
    clean = run_text(model, batch, layers=view, cone_layers=[0, 1, 2, 3])
    for key, run in data["patch"]["runs"].items():
        ri, si, _ = map(int, key.split(","))
        cmp = cw_lens.compare_sink_patch(
            model, TEXT, layers=ranges[ri], scale=(0.0, 0.5)[si], view_layers=view, clean=clean
        )
        assert run == patched_payload(cmp, view), key


def test_widget_resumes_and_says_so(own_llama):
    llama = own_llama
    patcher = cw_lens.sink_patcher(llama, TEXT, layers=(1, 1), scale=0.0, layer=1)
    assert patcher.last_pass == "resumed at layer 1"
    patcher.update(layers=(0, 1), scale=0.5)
    assert patcher.last_pass == "full pass: the patch starts at layer 0"
    patcher.update(layers=(1, 1), layer=0)
    want = patch_state(llama, TEXT, patcher.controls, layer=0)
    assert patcher.last_pass == "resumed at layer 1" and patcher.patched == want["patched"]
    assert patcher.data == want["data"]


@pytest.mark.model
@pytest.mark.compat
@pytest.mark.parametrize("which", ["own_smollm", "own_smollm_hooked"])
def test_embedded_model_resumes_exactly(which, request):
    """SmolLM2-135M (30 layers), as a bridge and as a HookedTransformer where TransformerLens
    has one: the patch from layer 0, the middle (viewed after and before it) and the last."""
    model = request.getfixturevalue(which)
    check_resume(model, PROSE, (0, 29), [20])
    check_resume(model, PROSE, (10, 19), [20])
    check_resume(model, PROSE, (15, 15), [3], heads=[0, 8], mode="norm_matched")
    check_resume(model, PROSE, (29, 29), [29], scale=2.0)
