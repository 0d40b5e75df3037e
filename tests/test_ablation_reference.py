"""`sink_ablation` against an independent float64 reference, on several tiny architectures and
the embedded SmolLM2.

The reference runs each document alone (no padding) with hooks that keep `hook_z`, `hook_v` and
`hook_pattern`, and computes every number in float64 from `d_model` vectors (`o = z W_O`,
`pv = v W_O`), with Python loops over documents, layers and heads: the cone axis, each counted
query's output norm and cone alignment before and after, the relative output norm, and the
next-token NLL from the logits. The patched run (the patched NLL, and the "after" outputs of
`effect="total"`) is the model with `patch_sink`'s hooks applied by hand. The library streams
batches (padded), reduces in float32 per block and sums in float64: every per-head mean within
`RTOL`/`ATOL` of the reference, every NLL within `NLL_ATOL`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import cw_lens
from cw_lens.analyses.sinks.cone import ABLATION_SUMS
from cw_lens.data.inputs import prepare_inputs

# the library's float32 per-block reductions against float64 sums: relative 1e-4 (float32
# activations of a float32 model batched with padding differ from a single document's by ~1e-6)
RTOL, ATOL = 1e-4, 1e-5
NLL_ATOL = 2e-5
TEXTS = [
    "the sink holds the rest in check",
    "semantic cones and drift",
    "a much longer document about attention sinks, values and the cone they span",
    "short",
    "four words in all",
]
COLUMNS = ("norm_before", "cone_before", "count_before", "rel_norm")
AFTER = ("norm_after", "cone_after", "count_after")


def run_document(model, tokens, layers, hooks=()):
    """float64 logits and the kept `z`, `v` and pattern of each layer, one document alone."""
    store = {}

    def keeper(name):
        def keep(t, hook):
            store[name] = t.detach()[0].double().clone()

        return keep

    names = [f"blocks.{layer}.attn.hook_{k}" for layer in layers for k in ("z", "v", "pattern")]
    keep = [(name, keeper(name)) for name in names]
    with torch.inference_mode(), model.hooks(fwd_hooks=[*hooks, *keep]):
        logits = model(tokens)[0].double()
    return logits, store


def cone_sums(model, store, layer, heads, sinks, factor=None):
    """Per head: the sums over counted queries of `||o_i||`, `cos(o_i, u)`, the count and
    `||o_i|| / mean_j ||pv_j||`; with `factor[h]` (the share of the sink term removed) the
    same of `o_i - factor[h] sum_{j in sinks} alpha[i,j] pv_j` too."""
    z = store[f"blocks.{layer}.attn.hook_z"]  # [pos, head, d]
    v = store[f"blocks.{layer}.attn.hook_v"]  # [pos, kv, d]
    pattern = store[f"blocks.{layer}.attn.hook_pattern"]  # [head, q, k]
    W_O = model.blocks[layer].attn.W_O.detach().double()  # [head, d, d_model]
    n_pos, n_heads = z.shape[0], z.shape[1]
    group = n_heads // v.shape[1]
    inside = [s for s in sinks if s < n_pos]
    tail = [j for j in range(n_pos) if j not in inside]
    queries = [i for i in range(n_pos) if i not in inside and i > min(sinks)]
    out = {}
    for h in heads:
        o = z[:, h] @ W_O[h]  # [pos, d_model]
        pv = v[:, h // group] @ W_O[h]
        u = pv[tail].mean(0)
        mean_pv = pv[tail].norm(dim=-1).mean()
        outputs = {"before": o[queries]}
        if factor is not None:
            sink_term = pattern[h][:, inside] @ pv[inside]  # [pos, d_model]
            outputs["after"] = (o - factor[h] * sink_term)[queries]
        sums = {}
        for tag, x in outputs.items():
            norm = x.norm(dim=-1)
            ok = (norm > 0) & (u.norm() > 0)
            cos = (x @ u) / (norm * u.norm()).clamp_min(1e-300)
            sums[f"norm_{tag}"] = float(norm[ok].sum())
            sums[f"cone_{tag}"] = float(cos[ok].sum())
            sums[f"count_{tag}"] = float(ok.sum())
            if tag == "before":
                sums["rel_norm"] = float((norm[ok] / mean_pv).sum())
        out[h] = sums
    return out


def document_nll(logits, tokens):
    """(NLL sum, count) of next-token prediction over one document (float64)."""
    nll = -logits.log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None].to(logits.device))[:, 0]
    return float(nll.sum()), float(nll.numel())


def sink_factor(store, model, layer, heads, sinks, scale, mode):
    """The patch's `1 - lambda` per head (norm-matched: lambda = mean tail / mean sink norm)."""
    if mode == "scale":
        return {h: 1.0 - scale for h in heads}
    v = store[f"blocks.{layer}.attn.hook_v"]
    W_O = model.blocks[layer].attn.W_O.detach().double()
    n_pos, group = v.shape[0], model.cfg.n_heads // v.shape[1]
    inside = [s for s in sinks if s < n_pos]
    tail = [j for j in range(n_pos) if j not in inside]
    out = {}
    for h in heads:
        norms = (v[:, h // group] @ W_O[h]).norm(dim=-1)
        out[h] = 1.0 - float(norms[tail].mean() / norms[inside].mean())
    return out


def reference(model, texts, plan, *, scale=0.0, mode="scale", effect="direct", sinks=(0,)):
    """Per document: `{(layer, head): sums}` and the clean and patched `(NLL sum, count)`."""
    prepared = prepare_inputs(model, texts, prepend_bos=True)
    layers = sorted(plan)
    n_heads = model.cfg.n_heads
    hooks = cw_lens.patch_sink(
        model, heads=plan, scale=scale, mode=mode, sink_positions=sinks
    ).hooks
    documents = []
    for d in range(len(texts)):
        length = int(prepared.lengths[d])
        tokens = prepared.tokens[d : d + 1, :length]
        assert bool(prepared.mask[d, :length].all())  # right-padded
        logits, store = run_document(model, tokens, layers)
        patched_logits, patched_store = run_document(model, tokens, layers, hooks)
        heads = {}
        for layer in layers:
            every = list(range(n_heads))
            if effect == "direct":
                factor = sink_factor(store, model, layer, every, sinks, scale, mode)
                factor = {h: f if h in plan[layer] else 0.0 for h, f in factor.items()}
                sums = cone_sums(model, store, layer, every, sinks, factor)
            else:
                sums = cone_sums(model, store, layer, every, sinks)
                after = cone_sums(model, patched_store, layer, every, sinks)
                for h in every:
                    sums[h].update({k.replace("before", "after"): after[h][k] for k in COLUMNS[:3]})
            heads.update({(layer, h): s for h, s in sums.items()})
        documents.append(
            {
                "heads": heads,
                "clean": document_nll(logits, tokens),
                "patched": document_nll(patched_logits, tokens),
            }
        )
    return documents


def check(result, documents, plan):
    """Every field of `result` against the per-document reference."""
    got = result.per_head.set_index(["layer", "head"])
    for layer, hs in plan.items():
        for h in hs:
            total = {
                k: sum(doc["heads"][(layer, h)][k] for doc in documents) for k in (*COLUMNS, *AFTER)
            }
            row = got.loc[(layer, h)]
            want = {
                "norm_before": total["norm_before"] / total["count_before"],
                "cone_before": total["cone_before"] / total["count_before"],
                "relative_output_norm": total["rel_norm"] / total["count_before"],
                "norm_after": total["norm_after"] / total["count_after"],
                "cone_after": total["cone_after"] / total["count_after"],
            }
            for column, value in want.items():
                assert row[column] == pytest.approx(value, rel=RTOL, abs=ATOL), (layer, h, column)
    for kind, got_nll in (("clean", result.clean_nll), ("patched", result.patched_nll)):
        nll = sum(doc[kind][0] for doc in documents)
        count = sum(doc[kind][1] for doc in documents)
        assert got_nll == pytest.approx(nll / count, abs=NLL_ATOL), kind
    if result.per_document is None:
        return
    heads, nll, planned = result.per_document
    layers = sorted(plan)
    assert heads.shape == (len(documents), len(ABLATION_SUMS), len(layers), heads.shape[-1])
    for d, doc in enumerate(documents):
        for i, layer in enumerate(layers):
            assert planned[i].nonzero().flatten().tolist() == sorted(plan[layer])
            for h in plan[layer]:
                for s, name in enumerate(ABLATION_SUMS):
                    want = doc["heads"][(layer, h)][name]
                    assert float(heads[d, s, i, h]) == pytest.approx(want, rel=RTOL, abs=ATOL), (
                        d,
                        layer,
                        h,
                        name,
                    )
        want_nll = [*doc["clean"], *doc["patched"]]
        assert nll[d].tolist() == pytest.approx(want_nll, abs=NLL_ATOL * max(doc["clean"][1], 1))


def architecture(name):
    from architectures import BY_NAME, build

    built = build(replace(BY_NAME[name], dtype=torch.float32), seed=2)
    if built.bridge is None:  # this TransformerLens cannot wrap it
        pytest.skip(f"no TransformerBridge for {name} in this TransformerLens")
    return built.bridge


CASES = [
    ("llama", {"layers": [0, 1]}, {}),
    ("llama", {"heads": {1: [0, 3]}}, {"scale": 0.5, "effect": "total"}),
    ("llama", {"layers": [1]}, {"mode": "norm_matched"}),
    ("gpt2", {"layers": [0, 1]}, {"scale": 2.0}),
    ("gpt2", {"layers": [1]}, {"effect": "total"}),
    ("Qwen2", {"layers": [0, 1]}, {}),
    ("Gemma", {"layers": [1]}, {"effect": "total", "scale": 0.25}),
]


@pytest.mark.parametrize(
    "arch, where, options", CASES, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(CASES)]
)
def test_ablation_equals_a_float64_reference(request, arch, where, options):
    model = request.getfixturevalue(arch) if arch in ("llama", "gpt2") else architecture(arch)
    plan = cw_lens.models.interventions.per_layer_heads(
        model, where.get("layers"), where.get("heads")
    )
    documents = reference(model, TEXTS, plan, **options)
    for batch_size in (1, 3, 8):
        result = cw_lens.sink_ablation(
            model, TEXTS, **where, **options, batch_size=batch_size, per_document=True
        )
        check(result, documents, plan)


def test_ablation_is_batch_size_invariant(llama):
    runs = [
        cw_lens.sink_ablation(llama, TEXTS, effect="total", scale=0.5, batch_size=b)
        for b in (1, 3, 8)
    ]
    columns = ["relative_output_norm", "norm_before", "norm_after", "cone_before", "cone_after"]
    first = torch.tensor(runs[0].per_head[columns].to_numpy())
    for run in runs[1:]:
        assert torch.allclose(torch.tensor(run.per_head[columns].to_numpy()), first, RTOL, ATOL)
        assert run.clean_nll == pytest.approx(runs[0].clean_nll, abs=NLL_ATOL)
        assert run.patched_nll == pytest.approx(runs[0].patched_nll, abs=NLL_ATOL)
        assert (run.per_head["low_norm"] == runs[0].per_head["low_norm"]).all()


def test_the_reference_sees_a_wrong_count():
    """The check fails when one document's counted queries are off by one (it can fail)."""
    model = cw_lens.models.testing.tiny_llama(seed=0)
    plan = {1: [0, 1, 2, 3]}
    documents = reference(model, TEXTS[:2], plan)
    result = cw_lens.sink_ablation(model, TEXTS[:2], layers=[1], per_document=True)
    documents[0]["heads"][(1, 2)]["count_before"] += 1
    with pytest.raises(AssertionError):
        check(result, documents, plan)


@pytest.mark.slow
@pytest.mark.model
def test_ablation_equals_a_float64_reference_smollm(smollm):
    texts = [
        "The capital of France is Paris. The capital of Germany is Berlin.",
        "Attention sinks hold spare attention.",
        "One more short document, about the cone of each head.",
    ]
    for where, options in (
        ({"layers": [3, 14, 29]}, {}),
        ({"heads": {10: [0, 4, 8], 20: [1]}}, {"effect": "total", "scale": 0.5}),
    ):
        plan = cw_lens.models.interventions.per_layer_heads(
            smollm, where.get("layers"), where.get("heads")
        )
        documents = reference(smollm, texts, plan, **options)
        for batch_size in (1, 2):
            result = cw_lens.sink_ablation(
                smollm, texts, **where, **options, batch_size=batch_size, per_document=True
            )
            check(result, documents, plan)
