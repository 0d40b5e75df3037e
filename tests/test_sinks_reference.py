"""`sink_statistics` against an independent float64 reference, on several tiny architectures and
the embedded SmolLM2.

The reference runs each document alone (no padding) with hooks that keep `hook_z`, `hook_v` and
`hook_pattern`, and computes every per-head number of `heads()`, the curve of `curve()` and the
factor sums behind `decomposition()` in float64 from `d_model` vectors (`pv_j = v_j W_O`,
`o_i = z_i W_O`, the intra weights of `cw_lens.reference.layer_contributions`), with Python loops
over documents, layers, heads and queries (docs/methods.md#sinks, sink = position 0). The library
streams padded batches, reduces in float32 per block and sums in float64.

Tolerances: means within `RTOL` relative / `ATOL` absolute (float32 activations of a batched,
padded pass against one document's, float32 reductions over a block's queries and keys); counts
exact; histogram medians within one bin of the reference's (inverted-CDF) median of the raw
values (`s*`, drift cosine: 0.02; the cancelled share: one asinh bin, 1.84% relative).

The factor sample: per (layer, head, group) exactly the `max_samples` valid entries with the
smallest `entry_keys(seed, layer, document, head, query, key)` (a brute-force selection over the
reference's entries), the same rows for any batch size and query-block plan.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import cw_lens
import cw_lens.data.streaming as streaming
from cw_lens.core.accumulators import entry_keys
from cw_lens.data.inputs import prepare_inputs
from cw_lens.reference import layer_contributions

RTOL, ATOL = 2e-5, 2e-6
MIN_QUERY, DRIFT_K = 4, 4
S_STAR_BIN, DRIFT_COS_BIN = 1 / 50, 2 / 100
SHARE_BIN = 2 * math.asinh(1e9 / 1e-3) / 3000  # on asinh(v / 1e-3)
# different lengths (padding in a batch), every one longer than MIN_QUERY and DRIFT_K
TEXTS = [
    "the sink holds the rest in check, always",
    "semantic cones and drift",
    "a much longer document about attention sinks, values and the cone they span here",
    "short text, ten words",
    "four words in all, and a few more to make it longer",
]
FACTORS = ("attention", "relative_norm", "cosine", "contribution")


def run_document(model, tokens, layers):
    """The kept `z`, `v` and pattern of each layer (float64), one document alone."""
    store = {}

    def keeper(name):
        def keep(t, hook):
            store[name] = t.detach()[0].double().clone()

        return keep

    names = [f"blocks.{layer}.attn.hook_{k}" for layer in layers for k in ("z", "v", "pattern")]
    with torch.inference_mode(), model.hooks(fwd_hooks=[(n, keeper(n)) for n in names]):
        model(tokens)
    return store


def _cos(x, y):
    return float(x @ y / (x.norm() * y.norm()))


def reference(model, texts, layers):
    """Per (layer, head): lists of every per-query / per-token / per-entry value the statistics
    average, by loops over documents and queries; and the valid factor entries."""
    out = {}
    for d, text in enumerate(texts):
        tokens = prepare_inputs(model, [text]).tokens
        store = run_document(model, tokens, layers)
        for layer in layers:
            z = store[f"blocks.{layer}.attn.hook_z"]  # [pos, head, d]
            v = store[f"blocks.{layer}.attn.hook_v"]  # [pos, kv, d]
            pattern = store[f"blocks.{layer}.attn.hook_pattern"]  # [head, q, k]
            W_O = model.blocks[layer].attn.W_O.detach().double()
            dense = layer_contributions(pattern[None], v[None], z[None], W_O, kind="intra")
            n_pos, n_heads = z.shape[0], z.shape[1]
            group = n_heads // v.shape[1]
            for h in range(n_heads):
                r = out.setdefault((layer, h), {"entries": {"sink": [], "tail": []}})
                pv = v[:, h // group] @ W_O[h]  # [pos, d_model]
                p0 = pv[0]
                for t in range(1, n_pos):  # value geometry: every real non-sink token
                    if p0.norm() > 0:
                        ratio = float(pv[t].norm() / p0.norm())
                        r.setdefault("ratio", []).append(ratio)
                        r.setdefault("cos_token", []).append(_cos(p0, pv[t]))
                for i in range(1, n_pos):  # queries after the sink
                    a = pattern[h, i, : i + 1]
                    s = float(a[0])
                    o = z[i, h] @ W_O[h]
                    r.setdefault("rate_all", []).append(s)
                    r.setdefault("norm", []).append(float(o.norm()))
                    if i >= MIN_QUERY:
                        r.setdefault("rate", []).append(s)
                        b = min(max(math.floor(s * 20), 0), 19)
                        r.setdefault("curve", {}).setdefault(b, []).append(float(o.norm()))
                    for j in range(i + 1):
                        w = float(dense["weights"][0, h, i, j])
                        if not math.isnan(w):
                            row = [float(dense[f][0, h, i, j]) for f in FACTORS[:3]] + [w]
                            r["entries"]["sink" if j == 0 else "tail"].append((d, i, j, row))
                    if s <= 1e-6:
                        continue
                    st = s * p0
                    tail = (a[1:, None] * pv[1 : i + 1]).sum(0)
                    if s <= 0.999:
                        if tail.norm() > 0 and st.norm() > 0:
                            r.setdefault("cos_mixture", []).append(_cos(st, tail))
                        u = tail / (1 - s) - p0
                        if u @ u > 0:
                            m = tail / (1 - s)
                            r.setdefault("s_star", []).append(
                                min(max(float(m @ u / (u @ u)), 0.0), 1.0)
                            )
                    if i > DRIFT_K:  # a tail longer than drift_k
                        top = set((torch.topk(a[1:], DRIFT_K).indices + 1).tolist())
                        weak = [j for j in range(1, i + 1) if j not in top]
                        dr = (a[weak, None] * pv[weak]).sum(0)
                        if dr.norm() > 0 and st.norm() > 0:
                            r.setdefault("drift_cos", []).append(_cos(st, dr))
                            r.setdefault("drift_share", []).append(float(-(st @ dr) / (dr @ dr)))
    return out


def median(values):
    return float(np.quantile(np.array(values), 0.5, method="inverted_cdf"))


def expected_heads(ref):
    """The reference's `heads()` numbers per (layer, head)."""
    rows = {}
    for key, r in ref.items():
        e = {}
        e["sink_rate"] = np.mean(r["rate"])
        e["sink_head"] = e["sink_rate"] > 0.3
        e["sink_rate_all_queries"] = np.mean(r["rate_all"])
        e["output_norm"] = np.mean(r["norm"])
        e["norm_ratio"] = np.mean(r["ratio"])
        e["norm_ratio_geomean"] = math.exp(np.mean(np.log(r["ratio"])))
        e["cos_sink_token"] = np.mean(r["cos_token"])
        e["cos_sink_mixture"] = np.mean(r.get("cos_mixture", [math.nan]))
        for g in ("sink", "tail"):
            table = np.array([row for *_, row in r["entries"][g]])
            for k, f in enumerate(FACTORS):
                e[f"{g}_{f}"] = table[:, k].mean()
        s_star = np.array(r.get("s_star", []))
        e["s_star_count"] = len(s_star)
        e["s_star_at_0"] = np.mean(s_star <= 0)
        e["s_star_at_1"] = np.mean(s_star >= 1)
        e["s_star_median"] = median(s_star)
        e["drift_count"] = len(r["drift_cos"])
        e["drift_negative_share"] = np.mean(np.array(r["drift_cos"]) < 0)
        e["drift_cos_median"] = median(r["drift_cos"])
        e["drift_cancelled_median"] = median(r["drift_share"])
        rows[key] = e
    return rows


EXACT = ("s_star_count", "drift_count", "sink_head")
MEDIANS = {"s_star_median": S_STAR_BIN, "drift_cos_median": DRIFT_COS_BIN}


def assert_heads_match(stats, ref):
    heads = stats.heads().set_index(["layer", "head"])
    for key, e in expected_heads(ref).items():
        row = heads.loc[key]
        for name, want in e.items():
            got = row[name]
            where = (*key, name, float(got), float(want))
            if name in EXACT:
                assert got == want, where
            elif name in MEDIANS:
                assert abs(got - want) <= MEDIANS[name] + 1e-9, where
            elif name == "drift_cancelled_median":
                assert abs(math.asinh(got / 1e-3) - math.asinh(want / 1e-3)) <= SHARE_BIN, where
            elif name in ("s_star_at_0", "s_star_at_1"):
                assert got == pytest.approx(want, abs=1e-7), where  # (a float32 share)
            else:
                assert got == pytest.approx(want, rel=RTOL, abs=ATOL), where


def assert_curve_matches(stats, ref):
    curve = stats.curve(sink_heads_only=False)
    got = {(r.layer, r.head, round(r.sink_rate * 20 - 0.5)): r for r in curve.itertuples()}
    want = {(*key, b): v for key, r in ref.items() for b, v in r.get("curve", {}).items()}
    assert set(got) == set(want)
    for key, values in want.items():
        assert got[key].count == len(values), key
        assert got[key].output_norm == pytest.approx(np.mean(values), rel=RTOL, abs=ATOL), key


def assert_factor_sums_match(stats, ref):
    """The factor sums of every head (`decomposition()`'s `n` and the heads' factor means
    above are their ratios): the totals against the reference's."""
    for (layer, h), r in ref.items():
        li = stats.layers.index(layer)
        for g in ("sink", "tail"):
            table = np.array([row for *_, row in r["entries"][g]])
            count = stats.sums[li, h, stats.sum_names.index(f"{g}_count")]
            assert float(count) == len(table)
            for k, f in enumerate(FACTORS):
                total = float(stats.sums[li, h, stats.sum_names.index(f"{g}_{f}_sum")])
                assert total == pytest.approx(table[:, k].sum(), rel=RTOL, abs=ATOL * len(table))


def brute_force_sample(ref, seed, max_samples):
    """Per (layer, head, group): the (document, query, key) of the `max_samples` valid entries
    with the smallest keys, by sorting every entry's key."""
    out = {}
    for (layer, h), r in ref.items():
        for g in ("sink", "tail"):
            entries = r["entries"][g]
            coords = torch.tensor([(d, i, j) for d, i, j, _ in entries], dtype=torch.long)
            keys = entry_keys(
                seed, layer, coords[:, 0], torch.tensor(h), coords[:, 1], coords[:, 2]
            )
            keep = keys.argsort()[:max_samples]
            out[(layer, h, g)] = {tuple(coords[k].tolist()) for k in keep.tolist()}
    return out


def kept_sample(stats):
    out = {}
    for g in ("sink", "tail"):
        for row in stats.samples(g).itertuples():
            out.setdefault((row.layer, row.head, g), set()).add((row.document, row.query, row.key))
    return out


def architecture(name):
    from architectures import BY_NAME, build

    built = build(replace(BY_NAME[name], dtype=torch.float32), seed=2)
    if built.bridge is None:  # this TransformerLens cannot wrap it
        pytest.skip(f"no TransformerBridge for {name} in this TransformerLens")
    return built.bridge


@pytest.fixture(scope="module", params=["llama", "gpt2", "Qwen3"])
def case(request):
    """Llama (GQA 4/2, rotary), GPT-2 (biases, LayerNorm), Qwen3 (q/k norm, head_dim 16)."""
    arch = request.param
    model = request.getfixturevalue(arch) if arch in ("llama", "gpt2") else architecture(arch)
    layers = list(range(model.cfg.n_layers))
    return model, reference(model, TEXTS, layers)


OPTIONS = dict(min_query=MIN_QUERY, drift_k=DRIFT_K, progress=False)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_sink_statistics_equal_a_float64_reference(case, batch_size):
    model, ref = case
    stats = cw_lens.sink_statistics(model, TEXTS, batch_size=batch_size, **OPTIONS)
    assert_heads_match(stats, ref)
    assert_curve_matches(stats, ref)
    assert_factor_sums_match(stats, ref)


def test_the_sample_is_the_smallest_keys_whatever_the_batching(case, monkeypatch):
    model, ref = case
    max_samples, seed = 7, 11
    want = brute_force_sample(ref, seed, max_samples)
    kw = dict(OPTIONS, max_samples=max_samples, seed=seed)
    stats = cw_lens.sink_statistics(model, TEXTS, batch_size=8, **kw)
    assert kept_sample(stats) == want
    # every factor of every kept row is the reference's
    rows = {
        (layer, h, g, d, i, j): row
        for (layer, h), r in ref.items()
        for g in ("sink", "tail")
        for d, i, j, row in r["entries"][g]
    }
    for g in ("sink", "tail"):
        for s in stats.samples(g).itertuples():
            expected = rows[(s.layer, s.head, g, s.document, s.query, s.key)]
            got = [getattr(s, f) for f in FACTORS]
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
    for batch_size in (1, 3):
        other = cw_lens.sink_statistics(model, TEXTS, batch_size=batch_size, **kw)
        assert kept_sample(other) == want
    # blocks of 5 query rows instead of one block per batch
    monkeypatch.setattr(streaming, "auto_query_chunk", lambda *a, **k: 5)
    assert kept_sample(cw_lens.sink_statistics(model, TEXTS, batch_size=3, **kw)) == want


def test_batch_size_and_query_blocks_move_no_number(llama, monkeypatch):
    base = cw_lens.sink_statistics(llama, TEXTS, batch_size=8, **OPTIONS).heads()
    runs = [cw_lens.sink_statistics(llama, TEXTS, batch_size=b, **OPTIONS).heads() for b in (1, 3)]
    monkeypatch.setattr(streaming, "auto_query_chunk", lambda *a, **k: 5)
    runs.append(cw_lens.sink_statistics(llama, TEXTS, batch_size=3, **OPTIONS).heads())
    numeric = [c for c in base.columns if base[c].dtype.kind == "f"]
    for other in runs:
        assert (
            (other[[c for c in base.columns if c not in numeric]] == base.drop(columns=numeric))
            .all()
            .all()
        )
        np.testing.assert_allclose(
            other[numeric].to_numpy(), base[numeric].to_numpy(), rtol=RTOL, atol=ATOL
        )


@pytest.mark.model
@pytest.mark.slow
def test_sink_statistics_equal_a_float64_reference_on_smollm2(smollm):
    corpus = cw_lens.load_corpus(n_docs=4, max_tokens=64, model=smollm, seed=3)
    texts = [doc.text for doc in corpus]
    layers = [0, 1, 15, smollm.cfg.n_layers - 1]
    ref = reference(smollm, texts, layers)
    stats = cw_lens.sink_statistics(smollm, texts, layers=layers, batch_size=3, **OPTIONS)
    assert_heads_match(stats, ref)
    assert_curve_matches(stats, ref)
    assert_factor_sums_match(stats, ref)
