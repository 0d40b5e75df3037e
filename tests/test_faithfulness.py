"""The faithfulness protocol: ranking, removal, and the intervention against slow references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cw_lens
from cw_lens import reproduction
from cw_lens.analyses.faithfulness import (
    faithfulness,
    n_removed,
    rank_candidates,
    removal_mask,
    token_scores,
)
from cw_lens.analyses.faithfulness.ranking import Ranks
from cw_lens.data.inputs import prepare_inputs
from cw_lens.data.scoring import run_logits, token_nll
from cw_lens.reproduction.bootstrap import Bootstrap

TEXTS = ["attention is not explanation, says one paper", "contribution weights project values"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]), min_size=1, max_size=12),
    st.data(),
    st.booleans(),
)
def test_rank_candidates_equals_python_sort(scores, data, signed):
    valid = data.draw(st.lists(st.booleans(), min_size=len(scores), max_size=len(scores)))
    t = torch.tensor(scores)
    v = torch.tensor(valid)
    ranks = rank_candidates(t, v, signed=signed).tolist()
    key = [(s if signed else abs(s)) for s in scores]
    # valid first by importance; invalid ones tie with each other (index order)
    order = sorted(range(len(scores)), key=lambda i: (not valid[i], -key[i] if valid[i] else 0, i))
    assert [order.index(i) for i in range(len(scores))] == ranks


def test_removal_counts_and_modes():
    n_valid = torch.tensor([0, 1, 9, 40, 100])
    assert n_removed(n_valid, 0.01).tolist() == [0, 1, 1, 1, 1]
    assert n_removed(n_valid, 0.05).tolist() == [0, 1, 1, 2, 5]
    assert n_removed(n_valid, 0.0).tolist() == [0, 0, 0, 0, 0]
    assert n_removed(n_valid, 1.0).tolist() == n_valid.tolist()
    ranks = torch.arange(10)[None].expand(2, 10)
    nv = torch.tensor([10, 6])
    comp = removal_mask(ranks, nv, 0.2, "comprehensiveness")
    suff = removal_mask(ranks, nv, 0.2, "sufficiency")
    assert comp[0].nonzero().flatten().tolist() == [0, 1]
    assert suff[0].nonzero().flatten().tolist() == [8, 9]
    assert suff[1].nonzero().flatten().tolist() == [5]  # round(1.2) = 1 of the 6 valid


def test_token_scores_sum_heads_before_ranking():
    # one query, three key tokens, two heads. Signed sums [0.5, -1.0, 1.1] rank |.| as
    # key 2, key 1, key 0; the max over heads [3, 1, 0.6] or the summed |score| [5.5, 3, 1.1]
    # would rank key 0 first.
    scores = torch.tensor([[[[3.0, -2.0, 0.5]], [[-2.5, 1.0, 0.6]]]])  # [batch, head, q, key]
    summed = token_scores(scores)
    assert torch.allclose(summed, torch.tensor([[[0.5, -1.0, 1.1]]]))
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    assert rank_candidates(summed, valid).tolist() == [[[2, 1, 0]]]
    assert rank_candidates(summed, valid, signed=True).tolist() == [[[1, 2, 0]]]
    with_nan = scores.clone()
    with_nan[0, 1, 0, 2] = float("nan")  # NaN counts as 0
    assert torch.allclose(token_scores(with_nan), torch.tensor([[[0.5, -1.0, 0.5]]]))


def test_token_ranks_equal_a_reference_from_contribution_weights(llama):
    """Token granularity ranks |sum_h C[i,j]^h| per (layer, query) — against contribution_weights
    (inter) summed over heads and ranked with Python's sort (ties to the lower key)."""
    batch = prepare_inputs(llama, TEXTS[:1])
    layers = list(range(llama.cfg.n_layers))
    ranks = Ranks(batch, layers, llama.cfg.n_heads, ["contribution"], ["tokens"], False, 0)
    cw_lens.stream_contributions(
        llama, batch.tokens, ranks.update, attention_mask=batch.mask.long()
    )
    ref = cw_lens.contribution_weights(llama, TEXTS[:1], kind="inter")
    n = batch.tokens.shape[1]
    for li, layer in enumerate(layers):
        got = ranks.tokens["contribution", layer][0]
        for i in range(1, n):  # query 0 is never ranked (first_query=1)
            score = ref.weights[0, li, :, i, : i + 1].double().sum(0).abs().tolist()
            order = sorted(range(i + 1), key=lambda j: (-score[j], j))
            assert got[i, : i + 1].tolist() == [order.index(j) for j in range(i + 1)], (layer, i)


def test_query_zero_is_never_intervened_on_by_default(llama):
    batch = prepare_inputs(llama, TEXTS)
    layers = list(range(llama.cfg.n_layers))
    ranks = Ranks(batch, layers, llama.cfg.n_heads, ["attention"], ["pairs", "tokens"], False, 0)
    cw_lens.stream_contributions(
        llama, batch.tokens, ranks.update, attention_mask=batch.mask.long()
    )
    for granularity in ("pairs", "tokens"):
        for mode in ("comprehensiveness", "sufficiency"):
            (hook_set,) = ranks.hooks(llama, granularity, "attention", mode, 0.01, layers)
            for edit in hook_set.edits:
                pattern = torch.ones(2, llama.cfg.n_heads, *batch.tokens.shape[1:] * 2)
                kept = edit.effective_pattern(pattern, None)
                assert (kept[:, :, 0] == 1).all()  # query 0 untouched
                assert (kept[:, :, 1:] == 0).any()  # later queries lose something
    kw = dict(metrics=("attention",), fractions=(0.01,), modes=("sufficiency",), progress=False)
    default = faithfulness(llama, TEXTS, granularity="tokens", **kw)
    assert default.first_query == 1
    explicit = faithfulness(llama, TEXTS, granularity="tokens", first_query=1, **kw)
    every = faithfulness(llama, TEXTS, granularity="tokens", first_query=0, **kw)
    assert default.curves.equals(explicit.curves)
    assert not default.curves["delta_nll"].equals(every.curves["delta_nll"])


def test_fraction_zero_changes_nothing(llama):
    result = faithfulness(
        llama, TEXTS, fractions=(0.0,), granularity=("pairs", "tokens"), progress=False
    )
    assert (result.curves["delta_nll"] == 0).all()
    assert (result.curves["delta_ppl"] == 0).all()


def test_removing_every_pair_equals_zeroing_the_attention_output(tiny):
    batch = prepare_inputs(tiny, TEXTS)
    ranks = Ranks(
        batch,
        list(range(tiny.cfg.n_layers)),
        tiny.cfg.n_heads,
        ["attention"],
        ["pairs", "tokens"],
        False,
        0,
        first_query=0,
    )
    cw_lens.stream_contributions(tiny, batch.tokens, ranks.update, attention_mask=batch.mask.long())
    layers = list(range(tiny.cfg.n_layers))
    zero_z = [
        (f"blocks.{layer}.attn.hook_z", lambda z, hook: torch.zeros_like(z)) for layer in layers
    ]
    expected = run_logits(tiny, batch, zero_z)
    for granularity in ("pairs", "tokens"):
        got = run_logits(
            tiny,
            batch,
            ranks.hooks(tiny, granularity, "attention", "comprehensiveness", 1.0, layers),
        )
        real = batch.mask
        assert torch.allclose(got[real], expected[real], atol=1e-5)


def slow_reference_masks(model, text, fraction, mode):
    """Python loops over (layer, query >= 1): sort the (head, key) pairs by |C| (ties: lower
    head, then lower key) and mark the chosen ones; query 0 is left intact."""
    result = cw_lens.contribution_weights(model, text, kind="inter")
    n = result.tokens.shape[1]
    heads = model.cfg.n_heads
    masks = {}
    for li, layer in enumerate(result.layers):
        mask = torch.zeros(1, heads, n, n, dtype=torch.bool)
        for i in range(1, n):
            pairs = [(h, j) for h in range(heads) for j in range(i + 1)]
            score = {p: abs(float(result.weights[0, li, p[0], i, p[1]])) for p in pairs}
            order = sorted(pairs, key=lambda p: (-score[p], p[0], p[1]))
            k = max(1, int(fraction * len(pairs) + 0.5))
            chosen = order[:k] if mode == "comprehensiveness" else order[len(order) - k :]
            for h, j in chosen:
                mask[0, h, i, j] = True
        masks[layer] = mask
    return masks


@pytest.mark.parametrize("mode", ["comprehensiveness", "sufficiency"])
def test_intervention_equals_slow_reference(llama, mode):
    text = TEXTS[0]
    masks = slow_reference_masks(llama, text, 0.1, mode)
    batch = prepare_inputs(llama, text)
    logits = run_logits(llama, batch, cw_lens.mask_attention(llama, masks).hooks)
    nll_ref = token_nll(logits, batch.tokens, batch.mask).nanmean()
    clean = token_nll(run_logits(llama, batch), batch.tokens, batch.mask).nanmean()
    result = faithfulness(
        llama, [text], metrics=("contribution",), fractions=(0.1,), modes=(mode,), progress=False
    )
    assert result.clean["nll"] == pytest.approx(float(clean), abs=1e-6)
    assert result.curves["delta_nll"].iloc[0] == pytest.approx(float(nll_ref - clean), abs=1e-5)
    assert abs(float(nll_ref - clean)) > 1e-4  # the removal really changed something


def test_random_ranking_is_seeded(llama):
    kw = dict(metrics=("random",), fractions=(0.2,), progress=False)
    a = faithfulness(llama, TEXTS, seed=1, **kw).curves
    b = faithfulness(llama, TEXTS, seed=1, **kw).curves
    c = faithfulness(llama, TEXTS, seed=2, **kw).curves
    assert a.equals(b)
    assert not a["delta_nll"].equals(c["delta_nll"])


def test_random_draws_are_independent_and_their_spread_is_reported(llama):
    kw = dict(fractions=(0.1, 0.5), progress=False, seed=3, per_document=True)
    one = faithfulness(llama, TEXTS, metrics=("random",), **kw)
    three = faithfulness(llama, TEXTS, n_random=3, **kw)
    aopc = three.aopc()
    assert list(aopc.columns)[-3:] == ["random", "random#2", "random#3"]
    # the first draw is the one-draw run's ranking; the others are new rankings
    assert aopc["random"].equals(one.aopc()["random"])
    assert not aopc["random#2"].equals(aopc["random"])
    assert not aopc["random#3"].equals(aopc["random#2"])
    draws = aopc[["random", "random#2", "random#3"]]
    spread = three.random_spread()
    for row in aopc.index:
        values = sorted(float(v) for v in draws.loc[row])
        mean = sum(values) / 3
        sd = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
        assert spread.loc[row, "n_draws"] == 3
        assert spread.loc[row, "mean"] == pytest.approx(mean)
        assert spread.loc[row, "sd"] == pytest.approx(sd)
        assert (spread.loc[row, "min"], spread.loc[row, "max"]) == (values[0], values[2])
    assert (one.n_random_draws, three.n_random_draws) == (1, 3)
    claim = reproduction.claims(three, Bootstrap(resamples=50, seed=0))["faithfulness_order"]
    measured = claim["measured"]
    reported = measured["random_aopc_over_draws"]["comprehensiveness_pairs"]
    assert reported["n_draws"] == 3
    assert reported["sd"] == pytest.approx(spread.loc[("pairs", "comprehensiveness"), "sd"])
    assert {"random", "random#2", "random#3"} <= set(
        measured["aopc_interval_comprehensiveness_pairs"]
    )
    assert "random_aopc_over_draws" not in one_draw_claims(llama)
    # replicates(): the claim's numbers in every bootstrap row, the intervals the claim reports
    boot = Bootstrap(resamples=50, seed=0)
    checks = reproduction.claims(three, boot)["faithfulness_order"]["checks"]
    reps = reproduction.replicates(three, boot)
    assert {c["number"] for c in checks} == set(reps)
    numbers, per_layer = reproduction.intervals(three, boot)
    assert set(numbers) == set(reps) and per_layer == {}
    for check in checks:
        assert check["interval"] == pytest.approx(list(boot.pair(reps[check["number"]])))
        assert check["interval"] == pytest.approx(list(numbers[check["number"]]))
        assert check["value"] == pytest.approx(float(reps[check["number"]][50]))
    with pytest.raises(cw_lens.InputError, match="needs the 'random' metric"):
        faithfulness(llama, TEXTS, metrics=("attention",), n_random=2, progress=False)
    for bad in (0, True, 1.5):
        with pytest.raises(cw_lens.InputError, match="n_random must be"):
            faithfulness(llama, TEXTS, n_random=bad, progress=False)
    no_random = faithfulness(llama, TEXTS, metrics="attention", fractions=(0.1,), progress=False)
    with pytest.raises(cw_lens.InputError, match="no random ranking"):
        no_random.random_spread()
    assert no_random.n_random_draws == 0


def one_draw_claims(model) -> dict:
    result = faithfulness(model, TEXTS, fractions=(0.5,), progress=False)
    return reproduction.claims(result)["faithfulness_order"]["measured"]


def test_task_corpus_reports_answer_logprob_and_accuracy(llama):
    items = cw_lens.load_corpus("ioi", n_docs=3, seed=0)
    result = faithfulness(
        llama,
        items,
        metrics=("attention", "contribution"),
        fractions=(0.0, 0.5),
        modes=("comprehensiveness",),
        progress=False,
    )
    df = result.to_dataframe()
    assert {"delta_logprob", "accuracy", "logprob"} <= set(df.columns)
    zero = df[df["fraction"] == 0.0]
    assert (zero["delta_logprob"] == 0).all()
    assert (zero["accuracy"] == result.clean["accuracy"]).all()
    assert result.value_column == "delta_logprob"
    aopc = result.aopc()
    assert aopc.shape == (1, 2)


def test_aopc_and_claims_structure(llama):
    result = faithfulness(llama, TEXTS, fractions=(0.1, 0.5), progress=False)
    aopc = result.aopc()
    manual = result.curves.groupby(["mode", "metric"])["delta_nll"].mean()
    for (mode, metric), value in manual.items():
        assert aopc.loc[("pairs", mode), metric] == pytest.approx(value)
    claim = reproduction.claims(result)["faithfulness_order"]
    assert claim["holds"] in ("yes", "no") and "aopc_comprehensiveness_pairs" in claim["measured"]
    fig = result.plot()
    assert len(fig.axes) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metrics": ("saliency",)}, "Unknown metric"),
        ({"modes": ("both",)}, "Unknown mode"),
        ({"granularity": "heads"}, "granularity must be"),
        ({"fractions": (1.5,)}, r"fractions must lie in \[0, 1\]"),
        ({"ranking": "rank"}, "ranking must be"),
    ],
)
def test_bad_arguments(llama, kwargs, message):
    with pytest.raises(cw_lens.InputError, match=message):
        faithfulness(llama, TEXTS, progress=False, **kwargs)


def test_single_string_arguments_and_first_query(llama):
    a = faithfulness(
        llama, TEXTS, metrics="attention", modes="sufficiency", fractions=(0.1,), progress=False
    )
    assert list(a.curves["mode"]) == ["sufficiency"]
    with pytest.raises(cw_lens.InputError, match="first_query must be"):
        faithfulness(llama, TEXTS, first_query=-1, progress=False)
    skip = faithfulness(
        llama, TEXTS, metrics=("attention",), fractions=(1.0,), first_query=10**6, progress=False
    )
    assert (skip.curves["delta_nll"] == 0).all()  # no query left to intervene on


def test_a_crowded_figure_keeps_its_legends_off_the_curves(llama):
    """With the comparison's metrics (more than `CROWDED` lines a panel), each legend sits under
    its panel, not over the curves, and its AOPCs keep three significant digits."""
    from cw_lens.analyses.faithfulness.ranking import FIELD_METRICS, METRICS
    from cw_lens.plots.faithfulness import CROWDED

    corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=llama)
    result = cw_lens.faithfulness(
        llama,
        corpus,
        metrics=(*METRICS, *FIELD_METRICS, "random"),
        granularity=("pairs",),
        fractions=(0.1, 0.5),
        n_random=2,
        progress=False,
    )
    assert result.curves["metric"].nunique() > CROWDED
    fig = result.plot()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    aopc = result.aopc()
    for ax, mode in zip(fig.axes, ("comprehensiveness", "sufficiency"), strict=True):
        legend, panel = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.y1 < panel.y0, "the legend overlaps its panel"
        labels = {t.get_text() for t in ax.get_legend().get_texts()}
        row = aopc.loc[("pairs", mode)]
        assert labels == {f"{metric} ({value:.3g})" for metric, value in row.items()}
