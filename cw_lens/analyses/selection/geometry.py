"""Selection geometry over a corpus ([`selection_geometry`][cw_lens.selection_geometry]): P/R/F of
the top, random and sink-free selections per head, streamed into exact sums, and its result class
(its claims are judged in `cw_lens.reproduction.selection_claims`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Float64, Int
from torch import Tensor

from cw_lens.analyses.common import rounded_dict
from cw_lens.analyses.selection.accumulation import RULES, SelectionSums
from cw_lens.analyses.selection.prf import Distance
from cw_lens.core.deprecation import moved_to_reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.core.schema import Axes
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model


def head_f_ratio(f_without: pd.Series, f_with: pd.Series) -> pd.Series:
    """Per head: F(sink excluded) / F(sink allowed); `inf` where only the sink-free F is
    positive, NaN where both are 0.

    Args:
        f_without: Per head, F with the sink excluded (`top_no_sink`).
        f_with: Per head, F with the sink allowed (`top`), on the same index.

    Returns:
        The ratio per head.

    Examples:
        ```python
        import pandas as pd
        from cw_lens.analyses.selection import head_f_ratio

        head_f_ratio(pd.Series([0.5, 0.3, 0.0]), pd.Series([0.25, 0.0, 0.0]))  # 2, inf, NaN
        ```
    """
    ratio = f_without / f_with.where(f_with > 0)
    return ratio.mask((f_with == 0) & (f_without > 0), math.inf)


@saveable
@dataclass(repr=False)
class SelectionGeometryResult(Result):
    """F_N, P_N, R_N of the three selection rules per (layer, head, N), summed over a corpus.

    Attributes:
        sums: float64 totals `[layer, rule, head, n, 4]`: the sums of P, R, F over the scored
            queries (the random rule contributes each query's mean over its `n_random`
            rankings) and the number of scored queries.
        layers: Layer index of each entry of the layer axis (`result.layer(n)`: layer `n`
            only).
        n_grid: The N of each entry of the n axis.
        query: `"last"` (the last real position of each document) or `"all"`.
        n_random, seed: The random baseline's size and seed.
        sink_positions: Positions excluded by the `top_no_sink` rule.
        distance: `"euclidean"` or `"cosine"`.
        n_documents: Documents in the corpus.

    Means are NaN where no query was scored (a query needs at least `2N` keys); tables drop
    those entries.
    """

    _layer_axes = (("sums", 0),)

    sums: Float64[Tensor, "layer rule head n 4"]
    layers: Annotated[list[int], Axes("layer")]
    n_grid: Annotated[list[int], Axes("n")]
    query: Literal["last", "all"]
    n_random: int
    seed: int
    sink_positions: tuple[int, ...]
    distance: Distance
    n_documents: int
    model_name: str = ""
    per_document: Tensor | None = None  # [document, layer, rule, head, n, (F sum, queries)]

    @property
    def rules(self) -> tuple[str, ...]:
        return RULES if self.n_random else tuple(r for r in RULES if r != "random")

    @property
    def n_queries(self) -> Int[Tensor, "layer rule head n"]:
        """Scored queries per (layer, rule, head, N) (equal across rules unless several sink
        positions leave the sink-free rule fewer than N candidates)."""
        return self.sums[..., 3].long()

    def mean(self, metric: str = "f") -> Float[Tensor, "layer rule head n"]:
        """Mean `precision`, `recall` or `f` over the scored queries.

        Args:
            metric: `"precision"`, `"recall"` or `"f"`.

        Returns:
            A tensor `[layer, rule, head, n]`, NaN where no query was scored.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.mean("f").shape
            ```
        """
        index = {"precision": 0, "recall": 1, "f": 2}
        if metric not in index:
            raise InputError(f"metric must be 'precision', 'recall' or 'f', got {metric!r}.")
        count = self.sums[..., 3]
        return torch.where(count > 0, self.sums[..., index[metric]] / count, math.nan)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (layer, head, n, rule).

        Returns:
            A DataFrame with `layer, head, n, rule, precision, recall, f, n_queries`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.to_dataframe().head()
            ```
        """
        n_heads = self.sums.shape[2]
        layer, head, n = np.meshgrid(self.layers, range(n_heads), self.n_grid, indexing="ij")
        frames = []
        for r, rule in enumerate(RULES):
            if rule not in self.rules:
                continue
            frame = {"layer": layer.ravel(), "head": head.ravel(), "n": n.ravel(), "rule": rule}
            for metric in ("precision", "recall", "f"):
                frame[metric] = self.mean(metric)[:, r].numpy().ravel()
            frame["n_queries"] = self.n_queries[:, r].numpy().ravel()
            frames.append(pd.DataFrame(frame))
        df = pd.concat(frames, ignore_index=True)
        return df[df["n_queries"] > 0].reset_index(drop=True)

    def f_by_n(self, metric: str = "f") -> pd.DataFrame:
        """Mean over heads of each head's mean `metric`, per N and rule.

        Args:
            metric: `"precision"`, `"recall"` or `"f"`.

        Returns:
            A DataFrame indexed by `n`: one column per rule, with `top_over_random` (claim
            `topn_beats_random`) and `no_sink_over_sink` = F(top_no_sink) / F(top) (claim
            `sink_lowers_fn`: > 1 when the sink lowers F_N).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.f_by_n()
            ```
        """
        df = self.to_dataframe()
        table = df.pivot_table(index="n", columns="rule", values=metric, aggfunc="mean")
        table = table[list(self.rules)]
        if "random" in table:
            table["top_over_random"] = table["top"] / table["random"]
        table["no_sink_over_sink"] = table["top_no_sink"] / table["top"]
        table["n_heads"] = df[df["rule"] == "top"].groupby("n").size()
        table.columns.name = None
        return table

    def head_quantiles(self, q: Sequence[float] = (0.25, 0.75), metric: str = "f") -> pd.DataFrame:
        """Quantiles over heads of the per-head mean `metric`, per rule and N.

        Args:
            q: The quantiles.
            metric: `"precision"`, `"recall"` or `"f"`.

        Returns:
            A DataFrame with `rule, n` and one column per quantile (`q25`, `q75`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.head_quantiles(q=(0.1, 0.9))
            ```
        """
        df = self.to_dataframe()
        out = df.groupby(["rule", "n"])[metric].quantile(list(q)).unstack()
        out.columns = [f"q{round(100 * x)}" for x in q]
        return out.reset_index()

    def sink_effect(self) -> pd.DataFrame:
        """The sink's effect on F, per N (claim `sink_lowers_fn`).

        Returns:
            A DataFrame per N: mean F with and without the sink, their ratio, the share of heads
            whose F rises when the sink is excluded, the median per-head ratio and the share of
            heads whose ratio is at least 2 (`head_f_ratio`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.sink_effect()
            ```
        """
        df = self.to_dataframe().pivot_table(
            index=["layer", "head", "n"], columns="rule", values="f"
        )
        ratio = head_f_ratio(df["top_no_sink"], df["top"])
        per_n = pd.DataFrame(
            {
                "f_with_sink": df["top"].groupby("n").mean(),
                "f_without_sink": df["top_no_sink"].groupby("n").mean(),
                "share_heads_higher_without": (df["top_no_sink"] > df["top"]).groupby("n").mean(),
                "median_head_ratio": ratio.groupby("n").median(),
                "share_heads_at_least_2x": (ratio.dropna() >= 2).groupby("n").mean(),
            }
        )
        per_n.insert(2, "ratio", per_n["f_without_sink"] / per_n["f_with_sink"])
        return per_n

    def top(self, k: int = 10, *, n: int | None = None, rule: str = "top") -> pd.DataFrame:
        """The `k` heads with the highest mean F at one N.

        Args:
            k: How many heads.
            n: The selection size (default: the second N of the grid).
            rule: `"top"`, `"random"` or `"top_no_sink"`.

        Returns:
            `k` rows of [`to_dataframe`][cw_lens.SelectionGeometryResult.to_dataframe], highest F
            first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.top(5, n=2)
            ```
        """
        if rule not in self.rules:
            raise InputError(f"rule must be one of {self.rules}, got {rule!r}.")
        n = self.n_grid[min(1, len(self.n_grid) - 1)] if n is None else n
        if n not in self.n_grid:
            raise InputError(f"n={n} is not in this result's grid {self.n_grid}.")
        df = self.to_dataframe()
        df = df[(df["rule"] == rule) & (df["n"] == n)]
        return df.sort_values("f", ascending=False, kind="stable").head(k).reset_index(drop=True)

    def summary_dict(self) -> dict[str, Any]:
        """Headline numbers: mean F per N of each rule, and the sink's effect on it.

        Returns:
            A JSON-ready dict (`summary()` is this dict as a one-row DataFrame).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            geo.summary_dict()
            ```
        """
        table = self.f_by_n()
        out: dict[str, Any] = {
            "query": self.query,
            "n_documents": self.n_documents,
            "n_grid": self.n_grid,
            "f_top": rounded_dict(table["top"]),
            "f_top_no_sink": rounded_dict(table["top_no_sink"]),
            "no_sink_over_sink": rounded_dict(table["no_sink_over_sink"]),
            "median_head_no_sink_over_sink": rounded_dict(self.sink_effect()["median_head_ratio"]),
        }
        if "random" in table:
            out["f_random"] = rounded_dict(table["random"])
            out["top_over_random"] = rounded_dict(table["top_over_random"])
        return out

    claims = moved_to_reproduction("claims")  # deprecated: cw_lens.reproduction.claims(result)
    replicates = moved_to_reproduction("replicates")

    def plot(self, **kwargs: Any) -> Any:
        """F_N against N for top-N and the random baseline (claim `topn_beats_random`).

        Args:
            **kwargs: Passed to `cw_lens.plots.selection.plot_topn_beats_random` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            fig = geo.plot()
            ```
        """
        from cw_lens.plots.selection import plot_topn_beats_random

        return plot_topn_beats_random(self, **kwargs)

    def plot_sink_effect(self, **kwargs: Any) -> Any:
        """F_N with and without the sink (claim `sink_lowers_fn`).

        Args:
            **kwargs: Passed to `cw_lens.plots.selection.plot_sink_lowers_fn` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            geo = cw_lens.selection_geometry(model, corpus, progress=False)
            fig = geo.plot_sink_effect()
            ```
        """
        from cw_lens.plots.selection import plot_sink_lowers_fn

        return plot_sink_lowers_fn(self, **kwargs)


@check_keywords
def selection_geometry(
    model: Model,
    corpus: Any,
    *,
    n_grid: Sequence[int] | None = None,
    query: Literal["last", "all"] = "last",
    n_random: int = 16,
    seed: int = 0,
    sink_positions: Sequence[int] = (0,),
    distance: Distance = "euclidean",
    layers: int | Sequence[int] | None = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> SelectionGeometryResult:
    """P2's token-selection geometry: F_N of top-N, random and sink-free selections per head.

    Args:
        model: A `TransformerBridge` (`cw_lens.load_model()`).
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, or a list of strings.
        n_grid: Selection sizes N; `None` = 1, 2, 4, ... up to half the longest document.
            An N larger than half the longest document's length is an error.
        query: `"last"` scores the last real position of every document (P2's default);
            `"all"` every position `i >= 1` — about `T` times the work (use few
            documents or `layers=`).
        n_random: Random rankings per (head, query) for the baseline (0 = no baseline).
            Default 16, P2's protocol: a ranking is a few tensor operations on the values of
            the same pass (no extra forward pass), so its cost is small.
        seed: Seed of the random rankings (per document, layer and query; see module doc).
        sink_positions: Positions the `top_no_sink` rule removes from the candidates; each
            must be a token of every document (as in [`sink_statistics`][cw_lens.sink_statistics]).
        distance: `"euclidean"` (the default) or `"cosine"`.
        layers: Layers to analyse (`None` = all).
        batch_size: Documents per forward pass.
        prepend_bos: Prepend BOS (position 0 is then the usual sink).
        progress: Show a progress bar over document batches.
        per_document: Also keep each document's F sums and scored queries per (layer, rule,
            head, N) (`24 * n_layers * n_heads * len(n_grid) + 1` bytes per document, 45 KB
            for SmolLM2-135M at 128 tokens) for bootstrap intervals over documents
            (`cw_lens.reproduction.claims(result, Bootstrap(...))`).

    Returns:
        A [`SelectionGeometryResult`][cw_lens.SelectionGeometryResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        geo = cw_lens.selection_geometry(model, corpus, progress=False)
        geo.f_by_n()          # columns top, random, top_no_sink, top_over_random, ...
        fig = geo.plot()
        ```
    """
    accumulator = SelectionGeometryAccumulator(
        model,
        corpus,
        n_grid=n_grid,
        query=query,
        n_random=n_random,
        seed=seed,
        sink_positions=sink_positions,
        distance=distance,
        layers=layers,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = "selection geometry" if progress else False
    stats, _ = stream_corpus(
        model, corpus, [accumulator], batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )
    return accumulator.finish(stats)


class SelectionGeometryAccumulator(SelectionSums):
    """The accumulator of [`selection_geometry`][cw_lens.selection_geometry] (`name`
    `"selection"`): float64 sums of P_N, R_N, F_N and scored queries per (layer, rule, head,
    N) over the corpus, `sums[layer, rule, head, n] = sum over scored queries of (P, R, F, 1)`
    (the random rule: each query's mean over its rankings), and with `per_document=True` each
    document's own; `finish` builds the
    [`SelectionGeometryResult`][cw_lens.SelectionGeometryResult]. The arguments are
    [`selection_geometry`][cw_lens.selection_geometry]'s, less the pass's `progress`.

    Examples:
        ```python
        import cw_lens
        from cw_lens.analyses.selection import SelectionGeometryAccumulator
        from cw_lens.data.streaming import stream_corpus

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        acc = SelectionGeometryAccumulator(model, corpus, n_random=4)
        stats, _ = stream_corpus(model, corpus, [acc])
        acc.finish(stats).f_by_n()
        ```
    """

    def finish(self, stats: Any) -> SelectionGeometryResult:
        """The result of the merged sums (moved to the host once).

        Args:
            stats: The pass's `StreamStats`.

        Returns:
            A `SelectionGeometryResult`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            accumulator = cw_lens.SelectionGeometryAccumulator(model, texts)
            stats, _ = stream_corpus(model, texts, [accumulator])  # update(block) per block
            accumulator.finish(stats).f_by_n()
            ```
        """
        sums = self.sums.to_host()
        self._cache = {}  # the last batch's tables go with the pass
        record = sums.document_table()[..., 2:].clone() if self.per_document else None
        return SelectionGeometryResult(
            sums=sums.total.clone(),
            layers=list(self.layers),
            n_grid=list(self.n_grid),
            query=self.query,
            n_random=self.n_random,
            seed=self.seed,
            sink_positions=self.sink_positions,
            distance=self.distance,
            n_documents=stats.n_documents,
            model_name=self.model_name,
            per_document=record,
        )
