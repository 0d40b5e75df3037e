"""Sink analyses: the patch_sink intervention, s*, and statistics on planted sinks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import planted_sink_tensors, reference_ablation_heads, reference_sink_heads

import cw_lens
from cw_lens import reproduction
from cw_lens.core import geometry as geo
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.scoring import run_logits
from cw_lens.models.interventions import HookSet
from cw_lens.models.testing import random_tokens


def logits(model, tokens, hooks=()):
    with torch.inference_mode():
        return model.run_with_hooks(tokens, fwd_hooks=list(hooks))


def independent_sink_removal(model, layer, tokens, scale=0.0):
    """Remove (1 - scale) sum_h alpha[i,0]^h v_0 W_O^h from hook_attn_out for queries i > 0
    (not hook_z): scale 0 removes the sink's term, 2 doubles it."""
    store = {}

    def keeper(key):
        def keep(t, hook):  # hook.name is the bridge's canonical name, not the alias
            store[key] = t

        return keep

    def fix_out(out, hook):
        pattern, values = store["pattern"], store["values"]
        W_O = model.blocks[layer].attn.W_O.detach()
        group = model.cfg.n_heads // values.shape[2]
        pv0 = torch.stack(
            [values[:, 0, h // group] @ W_O[h] for h in range(model.cfg.n_heads)], 1
        )  # [batch, head, d_model]
        alpha0 = pattern[:, :, :, 0].clone()  # [batch, head, query]
        alpha0[:, :, 0] = 0.0  # the sink's own query is left alone
        return out - (1.0 - scale) * torch.einsum("bhq,bhm->bqm", alpha0, pv0)

    return [
        (f"blocks.{layer}.attn.hook_pattern", keeper("pattern")),
        (f"blocks.{layer}.attn.hook_v", keeper("values")),
        (f"blocks.{layer}.hook_attn_out", fix_out),
    ]


def test_patch_sink_equals_independent_removal(tiny):
    tokens = random_tokens(tiny, 2, 12, seed=1)
    for layer in range(tiny.cfg.n_layers):
        patched = logits(tiny, tokens, cw_lens.patch_sink(tiny, layers=[layer]).hooks)
        reference = logits(tiny, tokens, independent_sink_removal(tiny, layer, tokens))
        clean = logits(tiny, tokens)
        assert (patched - clean).abs().max() > 1e-3
        assert torch.allclose(patched, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [0.25, 1.5, 2.0])
def test_scaled_and_amplified_sink_equals_independent_edit(tiny, scale):
    """lambda in [0, 2]: pv_0 -> lambda pv_0, so above 1 the sink's term is amplified."""
    tokens = random_tokens(tiny, 2, 12, seed=5)
    layer = tiny.cfg.n_layers - 1
    patched = logits(tiny, tokens, cw_lens.patch_sink(tiny, layers=[layer], scale=scale).hooks)
    reference = logits(tiny, tokens, independent_sink_removal(tiny, layer, tokens, scale))
    assert (patched - logits(tiny, tokens)).abs().max() > 1e-4
    assert torch.allclose(patched, reference, atol=1e-5, rtol=1e-5)


def test_patch_one_head_leaves_its_gqa_partner_untouched(llama):
    tokens = random_tokens(llama, 1, 10, seed=2)
    captured = {}

    def keep_z(z, hook):
        captured.setdefault("z", []).append(z.clone())

    hooks = [*cw_lens.patch_sink(llama, layers=[0], heads=[0]), ("blocks.0.attn.hook_z", keep_z)]
    logits(llama, tokens, [("blocks.0.attn.hook_z", keep_z)])
    logits(llama, tokens, hooks)
    clean, patched = captured["z"]
    # heads 0 and 1 read kv head 0; only head 0 may change
    assert not torch.allclose(clean[:, 1:, 0], patched[:, 1:, 0])
    assert torch.equal(clean[:, :, 1:], patched[:, :, 1:])
    assert torch.equal(clean[:, 0], patched[:, 0])  # the sink's own query


def test_scale_one_is_identity_and_context_restores(tiny):
    tokens = random_tokens(tiny, 2, 9, seed=3)
    clean = logits(tiny, tokens)
    assert torch.equal(logits(tiny, tokens, cw_lens.patch_sink(tiny, scale=1.0).hooks), clean)
    with cw_lens.patch_sink(tiny, scale=0.0):
        inside = logits(tiny, tokens)
    assert not torch.allclose(inside, clean)
    assert torch.equal(logits(tiny, tokens), clean)
    half = logits(tiny, tokens, cw_lens.patch_sink(tiny, scale=0.5).hooks)
    assert not torch.allclose(half, clean) and not torch.allclose(half, inside)


def test_hook_sets_compose_with_user_hooks_and_nest(llama):
    tokens = random_tokens(llama, 1, 8, seed=4)
    a = cw_lens.patch_sink(llama, layers=[0])
    b = cw_lens.remove_heads(llama, [(1, 2)])
    combined = logits(llama, tokens, (a + b).hooks)
    with a, b:
        nested = logits(llama, tokens)
    assert torch.equal(combined, nested)
    seen = []
    with a:
        logits(llama, tokens, [("blocks.0.attn.hook_z", lambda z, hook: seen.append(z))])
    assert len(seen) == 1 and isinstance(a, HookSet)


def test_bad_patch_arguments(llama):
    with pytest.raises(cw_lens.InputError, match="scale must lie"):
        cw_lens.patch_sink(llama, scale=2.5)
    with pytest.raises(cw_lens.InputError, match="scale must lie"):
        cw_lens.patch_sink(llama, scale=-0.1)
    with pytest.raises(cw_lens.InputError, match="mode must be"):
        cw_lens.patch_sink(llama, mode="zero")
    with pytest.raises(cw_lens.InputError, match="out of range"):
        cw_lens.patch_sink(llama, layers=[7])


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6))
def test_counterfactual_sink_rate_equals_brute_force(seed, d_head):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(1, 1, 1, d_head, generator=gen, dtype=torch.float64)
    p = torch.randn(1, 1, 1, d_head, generator=gen, dtype=torch.float64) * 0.5
    W = torch.randn(1, d_head, d_head + 3, generator=gen, dtype=torch.float64)
    gram = geo.head_gram(W)
    s_star = float(geo.counterfactual_sink_rate(m, p, gram))
    grid = torch.linspace(0, 1, 20001, dtype=torch.float64)
    o = grid[:, None] * (p[0, 0, 0] @ W[0]) + (1 - grid[:, None]) * (m[0, 0, 0] @ W[0])
    brute = float(grid[o.norm(dim=-1).argmin()])
    assert abs(s_star - brute) <= 1e-4


GEOMETRY_CLAIMS = (
    "sink_value_norm_ratio",
    "sink_anti_alignment",
    "convex_sink_curve",
    "sink_cancels_drift",
)


def failing_claims(stats, names):
    claims = reproduction.claims(stats)
    return [name for name in names if claims[name]["holds"] != "yes"]


def planted_sink_hooks(model, sink_mass=0.6, sink_scale=-0.2):
    """Every head puts ``sink_mass`` on position 0; tail values share one direction c and the
    sink's value is ``sink_scale * c`` (anti-aligned and 5x smaller)."""
    gen = torch.Generator().manual_seed(0)
    d_head = model.cfg.d_head
    n_kv = model.cfg.n_key_value_heads or model.cfg.n_heads
    common = torch.randn(n_kv, d_head, generator=gen) * 3.0

    def values(v, hook):
        noise = torch.randn(v.shape, generator=gen) * 0.3
        out = common[None, None] + noise
        out[:, 0] = sink_scale * common
        return out.to(v.dtype)

    def pattern(p, hook):
        n = p.shape[-1]
        causal = torch.ones(n, n).tril()
        tail = causal.clone()
        tail[:, 0] = 0
        rows = tail.sum(-1, keepdim=True).clamp_min(1)
        out = tail / rows * (1 - sink_mass)
        out[:, 0] = sink_mass
        out[0, 0] = 1.0
        weights = torch.rand(p.shape, generator=gen) * 0.5 + 0.75  # uneven tail
        out = out * torch.where(torch.arange(n) == 0, 1.0, weights)
        out[..., 1:] = (
            out[..., 1:] / out[..., 1:].sum(-1, keepdim=True).clamp_min(1e-9) * (1 - sink_mass)
        )
        out[..., 0, :] = 0
        out[..., 0, 0] = 1.0
        return (out * causal).to(p.dtype)

    cw_lens.verify_model(model)  # before planting: the probe has its own shapes
    hooks = []
    for layer in range(model.cfg.n_layers):
        hooks += [
            (f"blocks.{layer}.attn.hook_v", values),
            (f"blocks.{layer}.attn.hook_pattern", pattern),
        ]
    return HookSet(model, hooks, "planted sink")


def test_statistics_on_a_planted_anti_aligned_sink(llama):
    texts = ["an attention sink is planted in every head of this model " * 2] * 3
    with planted_sink_hooks(llama):
        stats = cw_lens.sink_statistics(llama, texts, min_query=4)
    heads = stats.heads()
    assert heads["sink_head"].all()
    assert heads["sink_rate"].between(0.59, 0.61).all()
    assert (heads["norm_ratio"] > 4).all()  # tail ~ ||c||, sink 0.2 ||c||
    assert (heads["cos_sink_mixture"] < -0.9).all()
    assert (heads["cos_sink_token"] < -0.9).all()
    # o(s) = s(-0.2c) + (1-s)c is smallest at s = 1/1.2
    assert heads["s_star_median"].between(0.78, 0.88).all()
    assert heads["s_star_interior"].all()
    assert (heads["drift_cos_median"] < -0.9).all()
    assert (heads["drift_cancelled_median"] > 0).all()
    assert failing_claims(stats, GEOMETRY_CLAIMS) == []


def test_sink_rates_and_detection(llama):
    texts = ["hello attention", "a second, longer text here"]
    rates = cw_lens.sink_rates(llama, texts)
    full = cw_lens.contribution_weights(llama, texts)
    real = full.mask[:, None, None, :].expand_as(rates).clone()
    real[..., 0] = False
    assert torch.allclose(rates[real], full.attention[..., 0][real])
    assert rates[~real].isnan().all()
    long_texts = ["the planted sink sits at position zero of this text " * 2] * 2
    with planted_sink_hooks(llama):
        found = cw_lens.detect_sinks(llama, long_texts)
    assert found == [(0,), (0,)]
    with planted_sink_hooks(llama):
        assert cw_lens.detect_sinks(llama, long_texts, min_later=200) == [(), ()]


@pytest.mark.model
def test_detection_never_flags_the_end_of_a_document(smollm, prose):
    for doc, positions in zip(prose, cw_lens.detect_sinks(smollm, prose), strict=True):
        n = len(doc.tokens) + 1
        assert 0 in positions
        assert all(p < n - 16 for p in positions), positions


def test_short_documents_warn_instead_of_reporting_no_sinks(llama):
    with pytest.warns(RuntimeWarning, match="too short"):
        stats = cw_lens.sink_statistics(llama, ["tiny", "text"])
    assert stats.sink_rate.isnan().all() and not stats.sink_heads.any()


def test_ablation_direct_equals_total_for_one_layer_and_identity_at_scale_one(llama):
    texts = ["the sink holds the rest in check", "semantic cones and drift"]
    direct = cw_lens.sink_ablation(llama, texts, layers=[1])
    total = cw_lens.sink_ablation(llama, texts, layers=[1], effect="total")
    cols = ["norm_before", "norm_after", "cone_before", "cone_after"]
    assert torch.allclose(
        torch.tensor(direct.per_head[cols].to_numpy()),
        torch.tensor(total.per_head[cols].to_numpy()),
        atol=1e-5,
    )
    assert direct.delta_nll == pytest.approx(total.delta_nll)
    same = cw_lens.sink_ablation(llama, texts, layers=[1], scale=1.0)
    assert same.delta_nll == 0.0
    assert (same.per_head["cone_after"] == same.per_head["cone_before"]).all()
    assert direct.per_head["low_norm"].sum() == 1  # a quarter of 4 heads


def test_ablation_intervals_are_those_its_claims_read(llama):
    """`intervals(ablation, bootstrap)` (registered with the ablation's claims and replicates)
    gives the intervals `claims(ablation, bootstrap)` judges, and no per-layer detail."""
    texts = ["the sink holds the rest in check", "semantic cones and drift", "a third text"]
    ablation = cw_lens.sink_ablation(llama, texts, layers=[1], per_document=True, progress=False)
    bootstrap = reproduction.Bootstrap(resamples=50)
    found, per_layer = reproduction.intervals(ablation, bootstrap)
    assert per_layer == {}
    checks = reproduction.claims(ablation, bootstrap)["sink_ablation_cone"]["checks"]
    assert (
        {c["number"] for c in checks}
        == set(found)
        == {
            "cone_rise_low_norm_minus_other",
            "delta_ppl",
        }
    )
    for check in checks:
        assert check["interval"] == pytest.approx(list(found[check["number"]]), nan_ok=True)
        assert np.isfinite(check["interval"]).all()


def test_intervention_argument_errors(llama):
    with pytest.raises(cw_lens.InputError, match=r"\(layer, head\) pairs"):
        cw_lens.remove_heads(llama, [0, 1])
    assert len(cw_lens.remove_heads(llama, [])) == 0  # removing nothing is allowed
    with pytest.raises(cw_lens.InputError, match="not both"):
        cw_lens.patch_sink(llama, layers=[1], heads={0: [0]})
    with pytest.raises(cw_lens.InputError, match="drift_k must be"):
        cw_lens.sink_statistics(llama, ["some text"], drift_k=0)
    extra = [("blocks.1.attn.hook_z", lambda z, h: z)]
    combined = cw_lens.patch_sink(llama, layers=[0]) + extra  # HookSet + list
    assert isinstance(combined, HookSet) and len(combined) == 4


def test_norm_matched_patch_does_not_depend_on_padding(llama):
    texts = ["a short text", "a noticeably longer text to pad the first one"]
    batch = prepare_inputs(llama, texts)
    alone = prepare_inputs(llama, texts[:1])
    patch = cw_lens.patch_sink(llama, layers=[1], mode="norm_matched", attention_mask=batch.mask)
    solo = cw_lens.patch_sink(llama, layers=[1], mode="norm_matched", attention_mask=alone.mask)
    padded = run_logits(llama, batch, patch.hooks)[0, : alone.tokens.shape[1]]
    single = run_logits(llama, alone, solo.hooks)[0]
    assert torch.allclose(padded, single, atol=1e-4)


# --------------------------------------------------------------------------- planted references

# four texts of 39 bytes: 40 positions with BOS, no padding
PLANTED_TEXTS = [
    "the sink sits at position zero, always.",
    "weak tokens drift; the sink cancels it!",
    "values point in many different ways....",
    "a fourth document keeps the counts up..",
]
N_POS = 40


def plant(model, patterns, values):
    """Replace every layer's attention pattern and values by the planted tensors (checked)."""

    def put(tensors):
        def hook(t, hook):
            layer = int(hook.name.split(".")[1])
            assert t.shape == tensors[layer].shape, (hook.name, t.shape)
            return tensors[layer].to(t.dtype)

        return hook

    cw_lens.verify_model(model)  # before planting: the probe has its own shapes
    hooks = []
    for layer in range(model.cfg.n_layers):
        hooks += [
            (f"blocks.{layer}.attn.hook_v", put(values)),
            (f"blocks.{layer}.attn.hook_pattern", put(patterns)),
        ]
    return HookSet(model, hooks, "planted tensors")


def planted_tensors(model, **kw):
    cfg = model.cfg
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    out = [
        planted_sink_tensors(
            len(PLANTED_TEXTS), N_POS, cfg.n_heads, n_kv, cfg.d_head, seed=layer, **kw
        )
        for layer in range(cfg.n_layers)
    ]
    return [p for p, _ in out], [v for _, v in out]


def inverted_cdf_median(values):
    return float(np.quantile(np.array(values), 0.5, method="inverted_cdf"))


@pytest.fixture(scope="module")
def planted_sinks(llama):
    # layer 1's sink value is larger: several heads cancel more than twice their drift
    patterns, values = planted_tensors(llama, sink=-0.3)
    patterns1, values1 = planted_tensors(llama, sink=-0.9)
    patterns[1], values[1] = patterns1[1], values1[1]
    with plant(llama, patterns, values):
        stats = cw_lens.sink_statistics(llama, PLANTED_TEXTS, min_query=4)
    return stats, patterns, values


def test_sink_statistics_equal_a_float64_reference_on_planted_sinks(llama, planted_sinks):
    """Tail values in many directions, uneven norms and attention, queries with s = 0.9995 and
    s = 1: every per-head statistic against loops over d_model vectors."""
    stats, patterns, values = planted_sinks
    heads = stats.heads().set_index(["layer", "head"])
    beyond_two = 0
    for layer in range(llama.cfg.n_layers):
        W_O = llama.blocks[layer].attn.W_O.detach()
        ref = reference_sink_heads(patterns[layer], values[layer], W_O)
        for h, r in enumerate(ref):
            row = heads.loc[(layer, h)]
            ratio = np.array(r["norm_ratio"])
            assert row["norm_ratio"] == pytest.approx(ratio.mean(), rel=1e-5)
            assert row["norm_ratio_geomean"] == pytest.approx(
                np.exp(np.log(ratio).mean()), rel=1e-5
            )
            assert ratio.mean() > 1.1 * np.exp(np.log(ratio).mean())  # the two means differ
            assert row["cos_sink_mixture"] == pytest.approx(np.mean(r["cos_mixture"]), abs=1e-5)
            assert row["s_star_count"] == len(r["s_star"])  # s > 0.999 is skipped
            assert abs(row["s_star_median"] - inverted_cdf_median(r["s_star"])) <= 0.02 + 1e-9
            assert row["drift_count"] == len(r["drift_cos"])
            assert abs(row["drift_cos_median"] - inverted_cdf_median(r["drift_cos"])) <= 0.02 + 1e-9
            share = inverted_cdf_median(r["drift_share"])
            assert row["drift_cancelled_median"] == pytest.approx(share, rel=0.02, abs=1e-4)
            assert row["drift_negative_share"] == pytest.approx(
                np.mean(np.array(r["drift_cos"]) < 0)
            )
            beyond_two += abs(share) > 2
    assert beyond_two >= 2  # medians beyond a +-2 histogram must come back unclipped
    assert heads.loc[(0, 1), "s_star_count"] < heads.loc[(0, 0), "s_star_count"]


def test_planted_sink_claims_hold(planted_sinks):
    stats, _, _ = planted_sinks
    assert stats.heads()["sink_head"].all()
    assert failing_claims(stats, (*GEOMETRY_CLAIMS, "sink_attention_vs_contribution")) == []


def test_drivers_are_per_head_spearman_of_the_sampled_entries(planted_sinks):
    """drivers(): per (layer, head, group) Spearman rho of each factor with the contribution,
    against an independent rank computation (numpy, average ranks) of the samples."""
    stats, _, _ = planted_sinks
    drivers = stats.drivers().set_index(["layer", "head", "group"])
    for group in ("sink", "tail"):
        samples = stats.samples(group)
        assert len(samples)
        for (layer, head), g in samples.groupby(["layer", "head"]):
            row = drivers.loc[(layer, head, group)]
            assert row["n_samples"] == len(g)
            for factor in ("attention", "relative_norm", "cosine"):
                expected = numpy_spearman(g[factor].to_numpy(), g["contribution"].to_numpy())
                assert row[f"rho_{factor}"] == pytest.approx(expected, abs=1e-9)
    # the sink group keeps every sink entry here (fewer than samples_per_head per head)
    sink = stats.samples("sink")
    assert (sink["key"] == 0).all()
    assert len(sink) == len(PLANTED_TEXTS) * 2 * 4 * (N_POS - 1)


def numpy_spearman(a, b):
    """Pearson correlation of average ranks (ties share the mean rank)."""

    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(1, len(x) + 1)
        for value in np.unique(x):
            tie = x == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_ablation_per_head_numbers_equal_a_float64_reference(llama):
    """Noise-only values (no shared direction), the sink a tail-like vector (so including it
    moves the cone axis), kv head 1's values 10x larger (raw norms), heads 2-3 diffuse with
    little sink (low output norm relative to their values): against d_model loops."""
    gen = torch.Generator().manual_seed(5)
    sink = 1.5 * torch.randn(2, llama.cfg.d_head, generator=gen, dtype=torch.float64)
    kw = dict(
        common=0.0,
        sink=sink,
        kv_scale=(1.0, 10.0),
        focus=(3.0, 3.0, 0.0, 0.0),
        rates=[(0.2, 0.9), (0.2, 0.9), (0.0, 0.05), (0.0, 0.05)],
        near_one=False,
    )
    patterns, values = planted_tensors(llama, **kw)
    with plant(llama, patterns, values):
        ablation = cw_lens.sink_ablation(llama, PLANTED_TEXTS)
    got = ablation.per_head.set_index(["layer", "head"])
    rows = []
    for layer in range(llama.cfg.n_layers):
        W_O = llama.blocks[layer].attn.W_O.detach()
        for h, ref in enumerate(reference_ablation_heads(patterns[layer], values[layer], W_O)):
            row = got.loc[(layer, h)]
            for column, key in (
                ("norm_before", "norm_before"),
                ("norm_after", "norm_after"),
                ("cone_before", "cone_before"),
                ("cone_after", "cone_after"),
                ("relative_output_norm", "rel"),
            ):
                assert row[column] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), (
                    layer,
                    h,
                    column,
                )
            rows.append((layer, h, ref["rel"], ref["norm_before"]))
    by_relative = {(a, h) for a, h, _, _ in sorted(rows, key=lambda r: r[2])[:2]}
    by_raw = {(a, h) for a, h, _, _ in sorted(rows, key=lambda r: r[3])[:2]}
    assert by_relative != by_raw  # the fixture tells the two rankings apart
    assert set(got.index[got["low_norm"]]) == by_relative


@pytest.mark.model
def test_a_saved_sink_statistics_result_holds_its_tensors_and_little_else(smollm, tmp_path):
    """2 documents of 32 tokens of the embedded model: the file is the size of the tensors the
    result holds (float64 sums, histogram counts stored as int32, the float32 factor sample:
    about 15 MB here, most of it the sample of up to `max_samples` entries per head and group
    and the 3,002-bin cancelled-share histogram) plus at most 5%, and loads back with every
    table equal."""
    corpus = cw_lens.load_corpus("pydoc+stdlib", n_docs=2, max_tokens=32, model=smollm, seed=0)
    stats = cw_lens.sink_statistics(smollm, corpus, progress=False)
    path = tmp_path / "sinks.safetensors"
    stats.save(path)
    tensors = [stats.sums, stats.curve_sums, stats.samples_table]
    counts = [h.counts for h in (stats.s_star, stats.drift_cos, stats.drift_share)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    held += sum(4 * t.numel() for t in counts)  # stored as int32
    assert held < path.stat().st_size < 1.05 * held, (path.stat().st_size, held)
    back = cw_lens.load_result(path)
    assert back.heads().equals(stats.heads())
    assert back.curve().equals(stats.curve())
    assert back.samples("tail").equals(stats.samples("tail"))
