"""The live sink-patching path: every number the widget and the saved page show equals what
``patch_sink`` + ``contribution_weights`` + the model's own logits give directly, and the
per-head cone measures equal a float64 dense reference built from the hooks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cw_lens
from cw_lens.core.errors import InputError
from cw_lens.interactive.comparison import PatchControls, compare_sink_patch
from cw_lens.interactive.view_state import patch_state, sink_patch_data
from cw_lens.viz import token_label

TEXT = "hello world, attention sinks"
# payload values carry 4 significant digits: relative error at most 5e-4
RTOL, ATOL = 6e-4, 1e-6


def close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    got = np.array([math.nan if v is None else v for v in np.ravel(got)], dtype=np.float64)
    return bool(
        np.allclose(got, np.ravel(np.asarray(want, np.float64)), rtol, atol, equal_nan=True)
    )


def direct_logits(model, tokens, hooks=()):
    with torch.inference_mode(), model.hooks(fwd_hooks=list(hooks)):
        return model(tokens)[0].double()


def dense_cone(model, tokens, layer, hooks, sinks=(0,)):
    """Mean ||o_i^h|| and cos(o_i^h, u^h) per head, float64, from hook_z / hook_v and W_O:
    u^h = normalised mean of the head's non-sink projected values; queries after the first sink."""
    store = {}

    def keeper(name):
        def keep(t, hook):
            store[name] = t.detach().clone()

        return keep

    names = [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.attn.hook_v"]
    with torch.inference_mode(), model.hooks(fwd_hooks=[*hooks, *[(n, keeper(n)) for n in names]]):
        model(tokens)
    cache = store
    z = cache[f"blocks.{layer}.attn.hook_z"][0].double()  # [pos, head, d]
    v = cache[f"blocks.{layer}.attn.hook_v"][0].double()  # [pos, kv, d]
    W_O = model.blocks[layer].attn.W_O.detach().double()  # [head, d, d_model]
    n_pos, n_heads = z.shape[0], z.shape[1]
    group = n_heads // v.shape[1]
    tail = [j for j in range(n_pos) if j not in sinks]
    queries = [i for i in range(n_pos) if i not in sinks and i > min(sinks)]
    norm, cone = [], []
    for h in range(n_heads):
        o = z[:, h] @ W_O[h]  # [pos, d_model]
        pv = v[:, h // group] @ W_O[h]
        u = pv[tail].mean(0)
        u = u / u.norm()
        norm.append(float(o[queries].norm(dim=-1).mean()))
        cone.append(float((o[queries] @ u / o[queries].norm(dim=-1)).mean()))
    return np.array(norm), np.array(cone)


def check_maps(payload_map, result, layer, heads, kind):
    """A payload map (every head and the aggregate) against a ContributionResult."""
    n = result.tokens.shape[1]
    rows, cols = np.tril_indices(n)
    li = result.layers.index(layer)
    for hi, _ in enumerate(heads):
        got = payload_map["h"][hi]
        for key, field in (
            ("a", "attention"),
            ("r", "relative_norm"),
            ("c", "cosine"),
            ("w", "weights"),
        ):
            want = getattr(result, field)[0, li, hi].double().numpy()[rows, cols]
            assert close(got[key], want), (layer, hi, field)
        assert close(got["on"], result.output_norm[0, li, hi].double().numpy())
    w = result.weights[0, li].double()
    agg = w.sum(0) if kind == "inter" else w.mean(0)
    assert close(payload_map["all"]["w"], agg.numpy()[rows, cols])
    assert close(
        payload_map["all"]["a"], result.attention[0, li].double().mean(0).numpy()[rows, cols]
    )


def check_state(model, text, controls, layer, kind="intra", top_k=5):
    state = patch_state(model, text, controls, layer=layer, kind=kind, top_k=top_k)
    data, patched = state["data"], state["patched"]
    c = PatchControls.from_dict(model, controls)
    tokens = model.to_tokens(text)
    hooks = c.hooks(model).hooks
    tok = model.tokenizer
    for run, hk in ((data["clean"], ()), (patched, hooks)):
        logits = direct_logits(model, tokens, hk)
        probs = logits.softmax(-1)
        p, ids = probs.topk(top_k, dim=-1)
        assert close(run["top"]["p"], p.numpy())
        assert run["top"]["tok"] == [
            [token_label(tok.decode([i])) for i in row] for row in ids.tolist()
        ]
        nll = -logits.log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None])[:, 0]
        assert close(run["nll"], nll.numpy())
        assert run["nll_mean"] == pytest.approx(float(nll.mean()), rel=RTOL)
    clean_nll = (
        -direct_logits(model, tokens).log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None])[:, 0]
    )
    patched_nll = (
        -direct_logits(model, tokens, hooks)
        .log_softmax(-1)[:-1]
        .gather(-1, tokens[0, 1:, None])[:, 0]
    )
    assert close(patched["delta"]["nll"], (patched_nll - clean_nll).numpy(), atol=1e-5)
    # contribution maps: contribution_weights, clean and inside the patch_sink context
    heads = list(range(model.cfg.n_heads))
    clean_cw = cw_lens.contribution_weights(model, text, layers=[layer], kind=kind)
    check_maps(data["clean"]["maps"][0], clean_cw, layer, heads, kind)
    with c.hooks(model):
        patched_cw = cw_lens.contribution_weights(model, text, layers=[layer], kind=kind)
    if layer < c.layers[0]:
        assert patched["maps"] == [None]  # the patch cannot reach it: identical to clean
        assert torch.equal(patched_cw.weights.nan_to_num(), clean_cw.weights.nan_to_num())
    else:
        check_maps(patched["maps"][0], patched_cw, layer, heads, kind)
    # per-head output norms and cone alignment of every patched layer: dense float64 reference
    assert patched["cone"]["layers"] == c.layer_list
    for li, pl in enumerate(c.layer_list):
        n_clean, k_clean = dense_cone(model, tokens, pl, (), c.sinks)
        n_patch, k_patch = dense_cone(model, tokens, pl, hooks, c.sinks)
        assert close(patched["cone"]["norm"][li], n_patch, rtol=2e-3)
        assert close(patched["cone"]["cone"][li], k_patch, rtol=2e-3, atol=2e-4)
        assert close(patched["delta"]["clean_cone"][li], k_clean, rtol=2e-3, atol=2e-4)
        assert close(patched["delta"]["norm"][li], n_patch - n_clean, rtol=2e-3, atol=2e-3)
        assert close(patched["delta"]["cone"][li], k_patch - k_clean, rtol=2e-3, atol=5e-4)
    assert patched["controls"] == c.to_dict()
    return state


@pytest.mark.parametrize(
    "controls, layer, kind",
    [
        (
            {"layers": [0, 1], "heads": "all", "scale": 0.0, "mode": "scale", "sinks": [0]},
            1,
            "intra",
        ),
        (
            {"layers": [1, 1], "heads": [0, 3], "scale": 1.75, "mode": "scale", "sinks": [0]},
            1,
            "inter",
        ),
        (
            {"layers": [1, 1], "heads": [2], "scale": 0.0, "mode": "norm_matched", "sinks": [0, 3]},
            0,
            "intra",
        ),
    ],
)
def test_state_equals_direct_computation_tiny(llama, controls, layer, kind):
    state = check_state(llama, TEXT, controls, layer, kind)
    assert state["data"]["patch"]["options"]["free"]
    assert state["data"]["layers"] == [layer] and state["data"]["choices"] == [0, 1]


@pytest.mark.model
def test_state_equals_direct_computation_smollm(smollm):
    controls = {
        "layers": [10, 14],
        "heads": [0, 4, 8],
        "scale": 0.25,
        "mode": "scale",
        "sinks": [0],
    }
    state = check_state(
        smollm, "The capital of France is Paris. The capital of Germany is", controls, 14
    )
    # the patch is not a no-op on the real model: predictions and the cone move
    assert state["patched"]["delta"]["nll_mean"] != 0
    assert max(abs(v) for row in state["patched"]["delta"]["cone"] for v in row) > 1e-3


def test_gpt2_state(gpt2):
    check_state(gpt2, TEXT, {"layers": [0, 0], "scale": 0.5}, 1, "inter", top_k=3)


def test_clean_run_reuse_is_exact(llama):
    first = compare_sink_patch(llama, TEXT, layers=(0, 1), scale=0.0, view_layers=[0, 1])
    again = compare_sink_patch(
        llama, TEXT, layers=(1, 1), scale=0.5, view_layers=[1], clean=first.clean
    )
    fresh = compare_sink_patch(llama, TEXT, layers=(1, 1), scale=0.5, view_layers=[1])
    assert torch.equal(again.patched.top_probs, fresh.patched.top_probs)
    assert torch.equal(
        again.patched.weights.weights.nan_to_num(), fresh.patched.weights.weights.nan_to_num()
    )
    assert torch.equal(again.clean.nll, fresh.clean.nll)
    with pytest.raises(InputError, match="does not match"):
        compare_sink_patch(llama, TEXT, layers=(1, 1), sink_positions=(0, 2), clean=first.clean)
    df = fresh.heads()
    assert list(df.columns)[:3] == ["layer", "head", "patched_head"] and len(df) == 4
    assert fresh.top().shape == (5, 5) and len(fresh.to_dataframe()) == len(fresh.str_tokens) - 1
    assert fresh.delta_nll == pytest.approx(
        float((fresh.patched.nll - fresh.clean.nll).mean()), abs=1e-6
    )


def test_controls_validate(llama):
    good = PatchControls.of(llama, layers=(0, 1), heads=[3, 1], scale=2.0)
    assert good.layers == (0, 1) and good.heads == (1, 3) and good.to_dict()["heads"] == [1, 3]
    assert PatchControls.of(llama, layers=range(1, 2)).layers == (1, 1)
    assert PatchControls.of(llama, layers=-1).layers == (1, 1)
    assert PatchControls.from_dict(llama, good.to_dict()) == good
    bad = [
        dict(layers=(1, 0)),
        dict(layers=(0, 5)),
        dict(layers=[0, 1, 1]),
        dict(layers="0-1"),
        dict(heads=[]),
        dict(heads=[7]),
        dict(scale=2.5),
        dict(scale=-0.5),
        dict(mode="zero"),
        dict(sink_positions=(-1,)),
    ]
    for kw in bad:
        with pytest.raises(InputError):
            PatchControls.of(llama, **kw)
    with pytest.raises(InputError, match="Unknown patch controls"):
        PatchControls.from_dict(llama, {"layers": [0, 1], "lambda": 0.5})


def test_saved_page_sweep_runs_equal_direct_patches(llama):
    data = sink_patch_data(
        llama, TEXT, layers=[1], scales=(0.0, 1.0, 2.0), modes=("scale", "norm_matched")
    )
    o = data["patch"]["options"]
    assert o["ranges"] == [[0, 0], [1, 1], [0, 1]] and o["scales"] == [0.0, 1.0, 2.0]
    # every (range, scale, mode) precomputed; norm-matched ignores the scale (one run per range)
    assert sorted(data["patch"]["runs"]) == sorted(
        [f"{r},{s},0" for r in range(3) for s in range(3)] + [f"{r},0,1" for r in range(3)]
    )
    tokens = llama.to_tokens(TEXT)
    for key, run in data["patch"]["runs"].items():
        ri, si, mi = map(int, key.split(","))
        c = PatchControls.of(
            llama, layers=tuple(o["ranges"][ri]), scale=o["scales"][si], mode=o["modes"][mi]
        )
        assert run["controls"] == c.to_dict()
        probs = direct_logits(llama, tokens, c.hooks(llama).hooks).softmax(-1)
        assert close(run["top"]["p"], probs.topk(5, dim=-1).values.numpy()), key
        if c.scale == 1.0 and c.mode == "scale":  # lambda = 1: the clean model, maps not repeated
            assert run["maps"] == [None] and run["top"] == data["clean"]["top"]
            assert all(v == 0 for v in run["delta"]["nll"])
    # a map of a patched layer equals contribution_weights under the patch
    c = PatchControls.of(llama, layers=(1, 1), scale=2.0)
    with c.hooks(llama):
        cw = cw_lens.contribution_weights(llama, TEXT, layers=[1])
    check_maps(data["patch"]["runs"]["1,2,0"]["maps"][0], cw, 1, list(range(4)), "intra")
    assert data["patch"]["runs"]["1,2,0"]["delta"]["nll_mean"] != 0


def test_saved_page_arguments_validate(llama):
    for kw in (
        {"modes": ("scale", "scale")},
        {"modes": ("zero",)},
        {"modes": ()},
        {"scales": (0.0, 0.0)},
        {"scales": (0.0, 3.0)},
        {"ranges": [(1, 0)]},
        {"layers": [4]},
    ):
        with pytest.raises(InputError):
            sink_patch_data(llama, TEXT, **kw)
