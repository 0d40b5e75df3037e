"""The input-level deletion protocol (`cw_lens.input_deletion`): every recorded drop against a
removal done by hand, the greedy AOPC bounds against a slow greedy loop and the exhaustive
range, the candidates, the normalisation, and the errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import cw_lens
from cw_lens.analyses.faithfulness import n_removed, rank_candidates
from cw_lens.core.errors import InputError
from cw_lens.data.scoring import answer_logprobs
from cw_lens.flow.evaluation import target_items
from cw_lens.flow.input_deletion import INPUT_METHODS, input_scores

FRACTIONS = (0.1, 0.5)


@pytest.fixture(scope="module")
def setup():
    model = cw_lens.load_model("testing:tiny-llama")  # a byte-level tokenizer: short items
    items = [
        cw_lens.Document("When Ann and Bo met, Bo gave it to", answer=" Ann"),
        cw_lens.Document("Cy and Di sat; Di", answer=" ran"),
        cw_lens.Document("Ed, Flo and Gus", answer=" ate"),
    ]
    return model, items


@pytest.fixture(scope="module")
def result(setup):
    model, items = setup
    return cw_lens.input_deletion(
        model, items, fractions=FRACTIONS, n_random=2, batch_size=2, rows_per_pass=7,
        progress=False,
    )  # fmt: skip


def _logprob_removed(model, batch, spans, row, removed):
    """The answer's log-probability of one item with the keys `removed` masked in every layer."""
    n = int(batch.lengths[row])
    tokens = batch.tokens[row : row + 1, :n]
    mask = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    mask[0, 0, 0, list(removed)] = True
    with (
        torch.no_grad(),
        cw_lens.mask_attention(model, dict.fromkeys(range(model.cfg.n_layers), mask)),
    ):
        logits = model(tokens)
    return float(answer_logprobs(logits, tokens, [spans[row]])[0])


def test_every_drop_is_a_removal_done_by_hand(setup, result):
    model, items = setup
    batch, spans, _ = target_items(model, items)
    scores, clean, _ = input_scores(model, batch, spans, INPUT_METHODS)
    targets = torch.tensor([s - 1 for s, _ in spans])
    pos = torch.arange(batch.tokens.shape[1])
    valid = (pos[None] < targets[:, None]) & batch.mask & (pos[None] > 0)  # BOS excluded
    records = result.records.set_index(["item", "method", "draw", "mode", "fraction"])
    for method in ("contribution_rollout", "integrated_gradients", "value_zeroing"):
        rank = rank_candidates(scores[method], valid, signed=True)
        for row in range(len(spans)):
            n = int(valid[row].sum())
            for f in FRACTIONS:
                k = int(n_removed(torch.tensor([n]), f)[0])
                order = rank[row].argsort()[:n].tolist()
                removals = (("comprehensiveness", order[:k]), ("sufficiency", order[n - k :]))
                for mode, removed in removals:
                    got = records.loc[(row, method, 0, mode, f)]
                    want = float(clean[row]) - _logprob_removed(model, batch, spans, row, removed)
                    assert got["k"] == k and got["n_candidates"] == n
                    assert math.isclose(got["drop"], want, rel_tol=1e-4, abs_tol=1e-4), (
                        method, mode, f, row,
                    )  # fmt: skip


def test_greedy_bounds_against_a_slow_greedy_and_the_exhaustive_range(setup):
    model, _ = setup
    # a short item: BOS, then 6 bytes, so 5 candidates before the target position; bins of 1
    # and 3 tokens (every nested chain enumerable)
    doc = cw_lens.Document("Mo ate", answer=" x")
    result = cw_lens.input_deletion(
        model, [doc], methods=("attention_rollout",), fractions=(0.2, 0.5), n_random=1,
        progress=False,
    )  # fmt: skip
    batch, spans, _ = target_items(model, [doc])
    t = spans[0][0] - 1
    candidates = list(range(1, t))
    sizes = [int(n_removed(torch.tensor([len(candidates)]), f)[0]) for f in (0.2, 0.5)]
    clean = _logprob_removed(model, batch, spans, 0, [])
    cache: dict = {}

    def drop(removed):
        key = tuple(sorted(removed))
        if key not in cache:
            cache[key] = clean - _logprob_removed(model, batch, spans, 0, key)
        return cache[key]

    def slow_greedy(sign):
        chosen, at = [], {}
        for step in range(max(sizes)):
            best = max((j for j in candidates if j not in chosen),
                       key=lambda j: (sign * drop([*chosen, j]), -j))  # fmt: skip
            chosen.append(best)
            at[step + 1] = drop(chosen)
        return sum(at[k] for k in sizes) / len(sizes)

    lower, upper = result.items.loc[0, ["lower", "upper"]]
    assert math.isclose(lower, slow_greedy(-1.0), rel_tol=1e-4, abs_tol=1e-5)
    assert math.isclose(upper, slow_greedy(1.0), rel_tol=1e-4, abs_tol=1e-5)
    chains = [
        sum(drop(order[:k]) for k in sizes) / len(sizes)
        for order in itertools.permutations(candidates, max(sizes))
    ]
    assert min(chains) - 1e-5 <= lower <= upper <= max(chains) + 1e-5
    aopc = result.item_aopc().loc[0]
    method = aopc[("comprehensiveness", "attention_rollout")]
    assert min(chains) - 1e-5 <= method <= max(chains) + 1e-5


def test_naopc_places_each_item_in_its_range(result):
    aopc = result.item_aopc()
    bounds = result.items.set_index("item")
    want = aopc.sub(bounds["lower"], axis=0).div(bounds["upper"] - bounds["lower"], axis=0)
    got = result.naopc()
    for (mode, method), column in want.items():
        assert math.isclose(got.loc[method, mode], column.mean(), rel_tol=1e-9)
    assert (got["n_items"] == 3).all()
    assert set(got.index) == {*INPUT_METHODS, "random"}


def test_candidates_are_the_tokens_before_the_target(result):
    items = result.items
    assert (items["n_candidates"] == items["target_position"] - 1).all()  # BOS left out
    records = result.records
    assert set(records["mode"]) == {"comprehensiveness", "sufficiency"}
    assert (records.groupby("method")["draw"].nunique().loc["random"]) == 2


def test_bos_can_be_a_candidate(setup):
    model, items = setup
    r = cw_lens.input_deletion(
        model, items, methods=("attention_rollout",), fractions=(0.5,), n_random=0,
        exclude_bos=False, normalise=False, progress=False,
    )  # fmt: skip
    assert (r.items["n_candidates"] == r.items["target_position"]).all()
    with pytest.raises(InputError, match="normalise=True"):
        r.naopc()


def test_plot_and_summary(result):
    fig = result.plot()
    assert len(fig.axes) == 2
    summary = result.summary()
    assert set(summary["fraction"]) == set(FRACTIONS)
    assert result.top(2).shape[0] == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"methods": ("lime",)}, "methods must be among"),
        ({"fractions": (0.0,)}, "fractions must lie in"),
        ({"fractions": (1.5,)}, "fractions must lie in"),
        ({"modes": ("both",)}, "modes must be among"),
        ({"n_random": -1}, "n_random must be an integer >= 0"),
        ({"rows_per_pass": 0}, "rows_per_pass must be an integer >= 1"),
    ],
)
def test_bad_options_are_refused(setup, kwargs, match):
    model, items = setup
    with pytest.raises(InputError, match=match):
        cw_lens.input_deletion(model, items, progress=False, **kwargs)
