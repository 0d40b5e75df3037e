"""Figures draw the strings they show as written, never as mathtext (issue 51, item 6).

Token strings come from the model's vocabulary, run labels from the user and every string of a
loaded result from whoever wrote the file. In 0.4.1 a token `$\\frac{$` made `.plot()` (or the
first draw of its figure) raise matplotlib's mathtext `ValueError`, and `$x$` drew as an italic
x. Each result class with a `.plot()` is plotted here with hostile strings in the fields its
figure shows; the figure is drawn with Agg while matplotlib's mathtext parser is watched.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import matplotlib
import pytest
from matplotlib.mathtext import MathTextParser
from matplotlib.text import Text

import cw_lens

matplotlib.use("Agg")

# mathtext, a lone dollar, TeX specials, a newline (shown as `\n`), an escaped dollar
HOSTILE = ["$\\frac{$", "$x$", "a_b^c", "\n", "50$", "\\$5", "%#&~", "{}$y$"]
TEXT = "The cat sat on the mat."  # fewer tokens than the figures label (40)
TEXTS = [TEXT, "A second small document about the dog and the log."]


def shown(token: str) -> str:
    """A token as the figures label it (docs: `repr` without the quotes, 12 characters)."""
    return repr(token)[1:-1][:12]


def hostile_tokens(n: int) -> list[str]:
    return [HOSTILE[i % len(HOSTILE)] for i in range(n)]


def _draw(fig: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Draw `fig` with Agg; the strings matplotlib's mathtext parser was asked to parse."""
    parsed: list[str] = []
    original = MathTextParser.parse

    def watched(self, s, *args, **kwargs):
        parsed.append(s)
        return original(self, s, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(MathTextParser, "parse", watched)
        fig.canvas.draw()
    return parsed


def assert_literal(fig: Any, monkeypatch: pytest.MonkeyPatch, expected: list[str]) -> None:
    """The figure draws; each expected string is the whole text or part of one; every text
    holding a hostile string is drawn literally; mathtext parsed none of them."""
    parsed = _draw(fig, monkeypatch)
    texts = [t for t in fig.findobj(Text) if t.get_text()]
    strings = [t.get_text() for t in texts]
    for want in expected:
        assert any(want in s for s in strings), (want, strings)
    markers = [shown(h) for h in HOSTILE] + HOSTILE
    for text in texts:
        if any(m in text.get_text() for m in markers if m.strip()):
            assert text.get_parse_math() is False, text.get_text()
            assert text.get_usetex() is False, text.get_text()
    assert not [s for s in parsed if any(m in s for m in ("frac", "$x$", "a_b", "$y$"))], parsed
    # and every title, axis label, legend entry and free text, whatever it holds
    labels = [*fig.texts, *(t for legend in fig.legends for t in legend.get_texts())]
    for ax in fig.axes:
        labels += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend() is not None:
            labels += [*ax.get_legend().get_texts(), ax.get_legend().get_title()]
    labels = [t for t in labels if t.get_text()]
    assert labels
    assert [t.get_text() for t in labels if t.get_parse_math() or t.get_usetex()] == []


# ------------------------------------------------------------------ token strings


def _contributions(model):
    result = cw_lens.contribution_weights(model, TEXT, kind="intra")
    tokens = hostile_tokens(len(result.str_tokens[0]))
    result = dataclasses.replace(result, str_tokens=[tokens])
    return result.plot(layer=result.layers[0], head=0), tokens, tokens


def _rollout(model):
    result = cw_lens.contribution_rollout(model, TEXT)
    tokens = hostile_tokens(len(result.str_tokens[0]))
    return dataclasses.replace(result, str_tokens=[tokens]).plot(), tokens, tokens


def _shares(model):
    result = cw_lens.residual_shares(model, TEXT)
    tokens = hostile_tokens(len(result.str_tokens[0]))
    query = len(tokens) - 1  # the default: the last real token, named in the title
    return dataclasses.replace(result, str_tokens=[tokens]).plot(), tokens, [tokens[query]]


def _routes(model):
    result = cw_lens.routes(model, TEXT, threshold=0.05)
    tokens = hostile_tokens(len(result.str_tokens))
    return dataclasses.replace(result, str_tokens=tokens).plot(), tokens, tokens


TOKEN_PLOTS: dict[str, Callable] = {
    "ContributionResult": _contributions,
    "RolloutResult": _rollout,
    "ResidualSharesResult": _shares,
    "RouteGraphResult": _routes,
}


@pytest.mark.parametrize("name", sorted(TOKEN_PLOTS))
def test_token_strings_are_drawn_as_written(llama, monkeypatch, name):
    fig, tokens, drawn = TOKEN_PLOTS[name](llama)
    assert len(tokens) <= 40  # few enough to be tick labels
    assert_literal(fig, monkeypatch, [shown(t) for t in drawn])


@pytest.mark.parametrize("name", ["ContributionResult", "RolloutResult", "RouteGraphResult"])
def test_tick_labels_are_the_tokens_in_order(llama, monkeypatch, name):
    fig, tokens, _ = TOKEN_PLOTS[name](llama)
    _draw(fig, monkeypatch)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [shown(t) for t in tokens]
    assert all(t.get_parse_math() is False for t in ax.get_xticklabels())


# ------------------------------------------------------------------ other strings a file holds


def _deletion(model):
    result = cw_lens.rollout_deletion(model, TEXTS, ks=(1, 2), n_random=2)
    return dataclasses.replace(result, corpus=HOSTILE[0]).plot(), [HOSTILE[0]]


def _input_deletion(model):
    result = cw_lens.input_deletion(
        model, TEXTS, methods=("attention_rollout",), fractions=(0.5,), n_random=1,
        normalise=False, progress=False,
    )  # fmt: skip
    return dataclasses.replace(result, corpus=HOSTILE[0]).plot(), [HOSTILE[0]]


def _geometry(model):
    result = cw_lens.selection_geometry(model, TEXTS, n_random=2, progress=False)
    return dataclasses.replace(result, query=HOSTILE[1]).plot(), [HOSTILE[1]]


def _pruning(model):
    result = cw_lens.prune_heads(
        model, TEXTS, retention=(0.5,), n_random=2, per_document=True, progress=False
    )
    return dataclasses.replace(result, scope=HOSTILE[4]).plot(), [HOSTILE[4]]


def _faithfulness(model):
    result = cw_lens.faithfulness(model, TEXTS, fractions=(0.1, 0.5), progress=False)
    curves = result.curves.copy()
    curves["granularity"] = curves["granularity"].astype(str) + HOSTILE[7]
    return dataclasses.replace(result, curves=curves).plot(), [HOSTILE[7]]


def _comparison(model):
    from test_compare import RUN_A, RUN_B

    labels = [HOSTILE[0], HOSTILE[1]]
    return cw_lens.compare_runs([RUN_A, RUN_B], labels=labels).plot(), labels


def _claims(model):
    from cw_lens.reproduction.claim_plots import plot_per_layer_intervals

    rows = [
        {"layer": i, "number": HOSTILE[2], "value": 0.5, "low": 0.4, "high": 0.6} for i in (0, 1)
    ]
    claims = {HOSTILE[0]: {"per_layer": rows, "holds": HOSTILE[1], "checks": []}}
    return plot_per_layer_intervals(claims), [HOSTILE[0], HOSTILE[1], HOSTILE[2]]


def _statistics(model):
    return cw_lens.sink_statistics(model, TEXTS, progress=False).plot(), []


def _ablation(model):
    return cw_lens.sink_ablation(model, TEXTS, progress=False).plot(), []


def _taxonomy(model):
    return cw_lens.head_taxonomy(model, TEXTS, progress=False).plot(), []


OTHER_PLOTS: dict[str, Callable] = {
    "RolloutDeletionResult": _deletion,
    "InputDeletionResult": _input_deletion,
    "SelectionGeometryResult": _geometry,
    "PruningResult": _pruning,
    "FaithfulnessResult": _faithfulness,
    "RunComparisonResult": _comparison,
    "plot_per_layer_intervals": _claims,
    "SinkStatisticsResult": _statistics,
    "SinkAblationResult": _ablation,
    "HeadTaxonomyResult": _taxonomy,
}


@pytest.mark.parametrize("name", sorted(OTHER_PLOTS))
def test_strings_from_a_result_are_drawn_as_written(llama, monkeypatch, name):
    fig, expected = OTHER_PLOTS[name](llama)
    assert_literal(fig, monkeypatch, expected)


def test_every_result_class_with_a_plot_is_covered():
    """A new result class with a `.plot()` must be added to the cases above."""
    from cw_lens.core.registry import registered_classes

    plotted = {
        cls.__name__
        for cls in registered_classes().values()
        if isinstance(cls, type) and callable(getattr(cls, "plot", None))
    }
    assert plotted, "no registered result class has a .plot()"
    assert plotted <= set(TOKEN_PLOTS) | set(OTHER_PLOTS)


def test_numeric_tick_labels_keep_their_mathtext(llama, monkeypatch):
    """A log axis labels its ticks `$\\mathdefault{10^{1}}$`: the numbers stay formatted as
    matplotlib formats them (only the strings a figure is given are made literal)."""
    fig, _ = _faithfulness(llama)
    parsed = _draw(fig, monkeypatch)
    assert fig.axes[0].get_xscale() == "log"
    assert any(re.search(r"10\^\{", s) for s in parsed), parsed
