"""Selection geometry and the head taxonomy against slow float64 references written from the
definitions (docs/methods.md#selection, SPEC P2): Python loops over documents, queries and
heads on the activations of `run_with_cache`, on several tiny architectures (grouped-query and
multi-head attention, biases, padded batches) and on the embedded SmolLM2.

Tolerances: P, R and F of one query are ratios of counts, so the streamed float64 sums equal the
reference's up to the order of addition: means within `ATOL` = 1e-9 (a flipped comparison at a
near-tie would move a mean by more than 1e-3). The taxonomy's winner counts are integers (exact);
its mean norms and entropies are float32 activations summed in float64: `rtol` 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from cw_lens.analyses import selection as sel
from cw_lens.analyses import taxonomy as taxo
from cw_lens.core.accumulators import entry_keys
from cw_lens.data.inputs import prepare_inputs
from cw_lens.models.testing import tiny_gpt2, tiny_llama

ATOL = 1e-9
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads select tokens; some of them mostly look at the first one.",
    "Short text here",
    "Hello, small world!",
    "A fourth, rather longer document about sinks, values and the geometry of selection.",
]
ARCHITECTURES = {
    "llama-gqa": lambda: tiny_llama(seed=0, n_layers=2, n_heads=4, n_kv_heads=2),
    "llama-mha": lambda: tiny_llama(seed=1, n_layers=2, n_heads=4, n_kv_heads=4),
    "llama-gqa-8": lambda: tiny_llama(seed=2, n_layers=2, n_heads=8, n_kv_heads=2),
    "gpt2": lambda: tiny_gpt2(seed=0, n_layers=2),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_model(request):
    return ARCHITECTURES[request.param]()


def cached(model, texts):
    batch = prepare_inputs(model, texts)
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask.long())
    return batch, cache


# --------------------------------------------------------------------------- the reference


def reference_prf(y, ranked, n, distance):
    """P, R, F of S = ranked[:n] among the candidates `ranked`, written from the definition."""
    s = sum(y[j] for j in ranked[:n])
    d = {}
    for j in ranked:
        if distance == "euclidean":
            d[j] = float(torch.sqrt(((y[j] - s) ** 2).sum()))
        else:
            norms = max(float(y[j].norm() * s.norm()), 1e-12)
            d[j] = 1.0 - float((y[j] * s).sum()) / norms
    chosen, rest = ranked[:n], ranked[n:]
    rho_max = max(d[j] for j in chosen)
    rho_min = min((d[j] for j in rest), default=math.inf)
    p = n / (n + sum(d[j] <= rho_max for j in rest))
    r = sum(d[j] < rho_min for j in chosen) / n
    return p, r, (2 * p * r / (p + r) if p + r > 0 else 0.0)


def reference_geometry(
    model, texts, grid, query, n_random, seed, sinks=(0,), distance="euclidean", layers=None
):
    """Sums `[layer, rule, head, n, (P, R, F, count)]` by loops over documents, queries, heads."""
    batch, cache = cached(model, texts)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    layers = range(n_layers) if layers is None else layers
    out = torch.zeros(len(layers), 3, n_heads, len(grid), 4, dtype=torch.float64)
    for at, layer in enumerate(layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        values = cache[f"blocks.{layer}.attn.hook_v"].double()
        group = n_heads // values.shape[2]
        for doc, length in enumerate(batch.lengths.tolist()):
            queries = [length - 1] if query == "last" else range(1, length)
            for q in queries:
                if q < 1 or q in sinks:
                    continue
                rankings = sel.random_rankings(seed, doc, layer, q, n_heads, max(n_random, 1))
                for h in range(n_heads):
                    attention = pattern[doc, h, q, : q + 1]
                    y = attention[:, None] * values[doc, : q + 1, h // group]
                    top = sorted(range(q + 1), key=lambda j: (-float(attention[j]), j))
                    no_sink = [j for j in top if j not in sinks]
                    for k, n in enumerate(grid):
                        if 2 * n > q + 1:
                            continue
                        rules = {0: [top], 2: [no_sink] if len(no_sink) >= n else []}
                        rules[1] = [rankings[h, r].tolist() for r in range(n_random)]
                        for rule, ranked in rules.items():
                            if not ranked:
                                continue
                            prf = [reference_prf(y, rk, n, distance) for rk in ranked]
                            mean = [sum(v) / len(prf) for v in zip(*prf, strict=True)]
                            out[at, rule, h, k] += torch.tensor([*mean, 1.0], dtype=torch.float64)
    return out


def reference_taxonomy(model, texts, sinks=(0,)):
    """Winner counts `[layer, head, category]`, counted queries, mean output norm and entropy."""
    batch, cache = cached(model, texts)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    counts = torch.zeros(n_layers, n_heads, 3, dtype=torch.float64)
    norm_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    entropy_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for layer in range(n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        values = cache[f"blocks.{layer}.attn.hook_v"].double()
        z = cache[f"blocks.{layer}.attn.hook_z"].double()
        w_o = model.blocks[layer].attn.W_O.detach().double()  # [head, d_head, d_model]
        group = n_heads // values.shape[2]
        for doc, length in enumerate(batch.lengths.tolist()):
            for i in range(length):
                if i in sinks:
                    continue
                for h in range(n_heads):
                    scores = [
                        float(pattern[doc, h, i, j] * values[doc, j, h // group].norm())
                        for j in range(i + 1)
                    ]
                    winner = max(range(i + 1), key=lambda j: (scores[j], -j))
                    category = 0 if winner == i else 1 if winner in sinks else 2
                    counts[layer, h, category] += 1
                    norm_sum[layer, h] += float((z[doc, i, h] @ w_o[h]).norm())
                    a = pattern[doc, h, i, : i + 1]
                    entropy_sum[layer, h] += float(-(a[a > 0] * a[a > 0].log()).sum())
    n = counts.sum(-1)
    return counts, n, norm_sum / n, entropy_sum / n


# --------------------------------------------------------------------------- selection


@pytest.mark.parametrize("query", ["last", "all"])
def test_selection_sums_match_the_float64_reference(arch_model, query):
    texts = TEXTS if query == "last" else TEXTS[2:4]
    result = sel.selection_geometry(
        arch_model, texts, query=query, n_random=3, seed=5, batch_size=3, progress=False
    )
    expected = reference_geometry(arch_model, texts, result.n_grid, query, 3, 5)
    assert result.sums.shape == expected.shape
    assert torch.equal(result.sums[..., 3], expected[..., 3])  # scored queries: exact counts
    assert torch.allclose(result.sums, expected, atol=ATOL, rtol=0)


def test_selection_cosine_and_several_sinks_match_the_reference():
    model = ARCHITECTURES["llama-gqa"]()
    kwargs = {"sink_positions": (0, 1), "distance": "cosine", "n_random": 2, "seed": 3}
    result = sel.selection_geometry(model, TEXTS, batch_size=2, progress=False, **kwargs)
    expected = reference_geometry(
        model, TEXTS, result.n_grid, "last", 2, 3, sinks=(0, 1), distance="cosine"
    )
    assert torch.allclose(result.sums, expected, atol=ATOL, rtol=0)


def test_selection_is_the_same_at_batch_sizes_1_3_8():
    model = ARCHITECTURES["llama-gqa"]()
    runs = [
        sel.selection_geometry(
            model, TEXTS, n_random=4, batch_size=b, per_document=True, progress=False
        )
        for b in (1, 3, 8)
    ]
    for other in runs[1:]:
        assert torch.allclose(other.sums, runs[0].sums, atol=ATOL, rtol=0)
        assert torch.allclose(other.per_document, runs[0].per_document, atol=ATOL, rtol=0)
    # the record sums to the totals of F and of the counts
    assert torch.allclose(runs[0].per_document.sum(0), runs[0].sums[..., 2:], atol=ATOL, rtol=0)
    # the random means are within tolerance of each other across batch sizes (same rankings)
    means = [r.mean("f")[:, 1] for r in runs]
    assert all(torch.allclose(m, means[0], atol=ATOL, equal_nan=True) for m in means)


def test_random_rankings_are_the_argsort_of_their_keys():
    seed, layer, n_heads, n_random = 11, 1, 3, 4
    for doc, query in [(0, 1), (2, 7), (5, 12)]:
        rankings = sel.random_rankings(seed, doc, layer, query, n_heads, n_random)
        for h in range(n_heads):
            for r in range(n_random):
                keys = [
                    int(
                        entry_keys(
                            seed,
                            layer,
                            torch.tensor(doc * 2**32 + query),
                            torch.tensor(h * 2**40 + r * 2**24 + j),
                        )
                    )
                    for j in range(query + 1)
                ]
                brute = sorted(range(query + 1), key=lambda j: keys[j])
                assert rankings[h, r].tolist() == brute
    # the batched keys of the accumulator are the same keys
    docs, queries = torch.tensor([2, 5]), torch.tensor([[7], [12]])
    batched = sel.ranking_keys(seed, layer, docs, queries, n_heads, n_random, 13)
    for b, (doc, query) in enumerate([(2, 7), (5, 12)]):
        order = batched[b, :, 0, :, : query + 1].sort(dim=-1, stable=True).indices
        assert torch.equal(order, sel.random_rankings(seed, doc, layer, query, n_heads, n_random))
    # a ranking does not depend on how many are drawn (nested in n_random)
    assert torch.equal(
        sel.random_rankings(seed, 2, layer, 7, n_heads, 2),
        sel.random_rankings(seed, 2, layer, 7, n_heads, 4)[:, :2],
    )


def test_prf_of_rankings_equals_the_reference_per_row():
    gen = torch.Generator().manual_seed(0)
    for distance in sel.DISTANCES:
        y = torch.randn(3, 9, 4, generator=gen, dtype=torch.float64)
        orders = torch.stack([torch.randperm(9, generator=gen) for _ in range(6)]).view(3, 2, 9)
        candidates = torch.ones(3, 2, 9, dtype=torch.bool)
        grid = [1, 2, 3, 4]
        prf = sel.prf_of_rankings(y, orders, candidates, grid, distance)
        for row in range(3):
            for m in range(2):
                for k, n in enumerate(grid):
                    want = reference_prf(y[row], orders[row, m].tolist(), n, distance)
                    got = tuple(prf[row, m, k].tolist())
                    assert got == pytest.approx(want, abs=1e-12)


# --------------------------------------------------------------------------- taxonomy


def test_taxonomy_matches_the_float64_reference(arch_model):
    result = taxo.head_taxonomy(arch_model, TEXTS, batch_size=2, per_document=True, progress=False)
    counts, n, norm, entropy = reference_taxonomy(arch_model, TEXTS)
    table = result.table.set_index(["layer", "head"]).sort_index()
    shape = counts.shape[:2]
    assert torch.equal(torch.tensor(table["n_queries"].to_numpy()).view(shape).double(), n)
    for c, category in enumerate(taxo.CATEGORIES):
        share = torch.tensor(table[f"share_{category}"].to_numpy()).view(shape)
        assert torch.allclose(share, counts[..., c] / n, atol=1e-12, rtol=0)
    got_norm = torch.tensor(table["mean_output_norm"].to_numpy()).view(shape)
    assert torch.allclose(got_norm, norm, rtol=1e-5, atol=1e-7)
    got_entropy = torch.tensor(table["mean_entropy"].to_numpy()).view(shape)
    assert torch.allclose(got_entropy, entropy, rtol=1e-5, atol=1e-7)
    regimes = [taxo.REGIMES[int(i)] for i in counts.argmax(-1).view(-1)]  # ties: first
    assert table["regime"].tolist() == regimes
    assert torch.equal(result.per_document.sum(0), counts)  # each document's winner counts
    shares = result.regime_shares()
    assert shares.sum() == pytest.approx(1.0)
    assert shares["Retriever"] == pytest.approx(regimes.count("Retriever") / len(regimes))


def test_taxonomy_is_the_same_at_batch_sizes_1_3_8():
    model = ARCHITECTURES["llama-gqa"]()
    runs = [
        taxo.head_taxonomy(model, TEXTS, batch_size=b, per_document=True, progress=False)
        for b in (1, 3, 8)
    ]
    for other in runs[1:]:
        assert other.table["regime"].tolist() == runs[0].table["regime"].tolist()
        assert torch.equal(other.per_document, runs[0].per_document)
        for column in ("share_current", "mean_output_norm", "mean_entropy"):
            assert other.table[column].to_numpy() == pytest.approx(
                runs[0].table[column].to_numpy(), rel=1e-6
            )


# --------------------------------------------------------------------------- embedded model


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("query", ["last", "all"])
def test_embedded_selection_matches_the_reference(smollm, query):
    texts = ["The cat sat on the mat and looked at the dog.", "Paris is the capital of France."]
    layers = [0, 5]
    result = sel.selection_geometry(
        smollm, texts, query=query, n_random=2, layers=layers, batch_size=2, progress=False
    )
    expected = reference_geometry(smollm, texts, result.n_grid, query, 2, 0, layers=layers)
    assert torch.equal(result.sums[..., 3], expected[..., 3])
    assert torch.allclose(result.sums, expected, atol=ATOL, rtol=0)


@pytest.mark.model
@pytest.mark.slow
def test_embedded_taxonomy_matches_the_reference(smollm):
    texts = ["The cat sat on the mat and looked at the dog.", "Paris is the capital of France."]
    result = taxo.head_taxonomy(smollm, texts, batch_size=2, per_document=True, progress=False)
    counts, n, norm, _ = reference_taxonomy(smollm, texts)
    assert torch.equal(result.per_document.sum(0), counts)
    table = result.table.set_index(["layer", "head"]).sort_index()
    got_norm = torch.tensor(table["mean_output_norm"].to_numpy()).view(n.shape)
    assert torch.allclose(got_norm, norm, rtol=1e-5, atol=1e-7)
