"""Sink-norm ablation ([`sink_ablation`][cw_lens.sink_ablation]): perplexity, output norms and cone
alignment with the sink's projected value scaled by lambda.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.analyses.common import check_sinks_inside
from cw_lens.analyses.sinks.cone import ABLATION_SUMS, ConeStatistics
from cw_lens.analyses.sinks.detection import SinkSpec
from cw_lens.core.accumulators import StackedSums
from cw_lens.core.deprecation import moved_to_reproduction
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.documents import as_corpus
from cw_lens.data.inputs import TokenBatch
from cw_lens.data.scoring import NLLResult, corpus_nll
from cw_lens.data.streaming import stream_corpus
from cw_lens.models.access import Model
from cw_lens.models.interventions import patch_sink, per_layer_heads


@saveable
@dataclass(repr=False)
class SinkAblationResult(Result):
    """Result of [`sink_ablation`][cw_lens.sink_ablation].

    Attributes:
        clean_nll, patched_nll: Mean next-token NLL without / with the sink patched.
        per_head: One row per patched (layer, head): output norm and cone alignment before and
            after, the head's relative output norm, and `low_norm` (the quarter of heads with
            the smallest `mean ||o_i^h|| / mean_j ||pv_j^h||`).
        effect: `"direct"` (after = the same layer's output with the sink removed, same input)
            or `"total"` (after = measured in the patched run, upstream patches included).
    """

    clean_nll: float
    patched_nll: float
    per_head: pd.DataFrame
    scale: float
    mode: Literal["scale", "norm_matched"]
    effect: Literal["direct", "total"]
    layers: list[int]
    # opt-in: ([document, ABLATION_SUMS, layer, head] sums, [document, (clean nll, count,
    # patched nll, count)], the patched heads' mask [layer, head]) for bootstrap intervals
    per_document: tuple[Tensor, Tensor, Tensor] | None = None
    low_norm_quantile: float = 0.25

    @property
    def delta_nll(self) -> float:
        return self.patched_nll - self.clean_nll

    @property
    def clean_ppl(self) -> float:
        return math.exp(self.clean_nll)

    @property
    def patched_ppl(self) -> float:
        return math.exp(self.patched_nll)

    @property
    def delta_ppl(self) -> float:
        return self.patched_ppl - self.clean_ppl

    def layer(self, layer: int) -> SinkAblationResult:
        """This result for patched layer NUMBER `layer` alone.

        A `SinkAblationResult` with `layers == [layer]`: its `per_head` table (and
        `to_dataframe()`, `top()`, the per-document record) holds that layer's heads. The NLL
        and PPL stay those of all patched layers together: they have no per-layer value (to
        measure one layer's, patch it alone). (Until 0.3.3 `layer(n)` returned the table.)

        Args:
            layer: The layer number; a layer that was not patched raises
                [`InputError`][cw_lens.InputError] naming the patched ones.

        Returns:
            A `SinkAblationResult` of one layer.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            ablation = cw_lens.sink_ablation(model, corpus, progress=False)
            ablation.layer(1).to_dataframe()  # one row per head of layer 1
            ```
        """
        i = self.layer_index(layer)
        record = self.per_document
        if record is not None:
            heads, nll, planned = record
            record = (heads[:, :, i : i + 1].clone(), nll, planned[i : i + 1].clone())
        rows = self._layer_rows(self.per_head, layer)
        return replace(self, layers=[layer], per_head=rows, per_document=record)

    def top(self, k: int = 10, *, by: str = "cone_rise") -> pd.DataFrame:
        """The `k` patched heads with the largest `by`.

        Args:
            k: How many heads.
            by: `"cone_rise"` (`cone_after - cone_before`, the rise in cone alignment the
                claim reads), `"norm_change"` (`norm_after - norm_before`) or a numeric
                column of `per_head`.

        Returns:
            Those rows of `per_head`, with `cone_rise` and `norm_change` added, largest
            first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            ablation = cw_lens.sink_ablation(model, ["One text.", "Another one."], progress=False)
            ablation.top(3)  # the heads whose cone alignment rises most
            ```
        """
        table = self.per_head.assign(
            cone_rise=self.per_head["cone_after"] - self.per_head["cone_before"],
            norm_change=self.per_head["norm_after"] - self.per_head["norm_before"],
        )
        if by not in table.columns or by in ("layer", "head", "low_norm"):
            numeric = [c for c in table.columns if c not in ("layer", "head", "low_norm")]
            raise InputError(f"by must be one of {numeric}, got {by!r}.")
        return table.sort_values(by, ascending=False, kind="stable").head(k).reset_index(drop=True)

    def to_dataframe(self) -> pd.DataFrame:
        """The per-head table: one row per patched (layer, head).

        Returns:
            `per_head`: `layer, head, relative_output_norm, norm_before, norm_after, cone_before,
            cone_after, low_norm`, ...

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            ablation = cw_lens.sink_ablation(model, corpus, progress=False)
            ablation.to_dataframe().head()
            ```
        """
        return self.per_head

    def summary(self) -> pd.DataFrame:
        """Mean cone alignment and norm before/after for low-norm heads versus the rest.

        Returns:
            A DataFrame indexed by group: `cone_before, cone_after, norm_before, norm_after`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            ablation = cw_lens.sink_ablation(model, corpus, progress=False)
            ablation.summary()
            ```
        """
        df = self.per_head.copy()
        df["group"] = np.where(df["low_norm"], "low-norm heads", "other heads")
        cols = ["cone_before", "cone_after", "norm_before", "norm_after"]
        return df.groupby("group")[cols].mean()

    claims = moved_to_reproduction("claims")  # deprecated: cw_lens.reproduction.claims(result)
    replicates = moved_to_reproduction("replicates")

    def plot(self, **kw: Any) -> Any:
        """Cone alignment and output norm before and after, low-norm heads against the rest.

        Args:
            **kw: Passed to `cw_lens.plots.sinks.plot_sink_ablation_cone` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            ablation = cw_lens.sink_ablation(model, corpus, progress=False)
            fig = ablation.plot()
            ```
        """
        from cw_lens.plots.sinks import plot_sink_ablation_cone

        return plot_sink_ablation_cone(self, **kw)


@check_keywords
def sink_ablation(
    model: Model,
    corpus: Any,
    *,
    layers: Any = None,
    heads: Any = None,
    scale: float = 0.0,
    mode: Literal["scale", "norm_matched"] = "scale",
    sink_positions: Sequence[int] = (0,),
    effect: Literal["direct", "total"] = "direct",
    low_norm_quantile: float = 0.25,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    progress: bool = True,
    per_document: bool = False,
) -> SinkAblationResult:
    """Remove (or rescale) the sink's projected value and measure what changes
    (docs/methods.md#sinks).

    ΔPPL comes from the real intervention ([`cw_lens.patch_sink`][cw_lens.patch_sink] on all chosen
    layers and heads at once). Per head, `||o_i^h||` and `cos(o_i^h, u^h)` are measured before and
    after over queries after the sink: with `effect="direct"` the "after" output is the same
    layer's output with the sink's term removed (same input — exact, from the clean pass); with
    `effect="total"` it is measured in the patched run.

    Args:
        model: A TransformerLens model ([`cw_lens.load_model`][cw_lens.load_model]).
        corpus: What [`cw_lens.load_corpus`][cw_lens.load_corpus] returns, a string, a list of
            strings, or token ids (a tensor `[pos]` or `[batch, pos]`, or a list of token-id
            lists, read as given).
        layers: Layers to patch (`None` = all).
        heads: Heads to patch (`None` = all), as a list or `{layer: [heads]}`; negative
            indices count from the end (`-1` is the last head).
        scale: `lambda` in [0, 2]: the sink's projected value becomes `lambda pv_0` (0 removes
            it, 1 keeps it, 2 doubles it).
        mode: `"scale"` or `"norm_matched"` (sink norm set to the mean tail norm).
        sink_positions: Sink positions (default BOS); each must be a token of every document
            (as in [`sink_statistics`][cw_lens.sink_statistics]).
        effect: `"direct"` or `"total"` (see above).
        low_norm_quantile: Share of heads called "low-norm" (methods page: a quarter).
        batch_size: Documents per forward pass.
        prepend_bos: Prepend BOS to text (position 0 is then the usual sink).
        progress: Show a progress bar over document batches (a string: its label).
        per_document: Also keep each document's per-head sums and NLL sums (float64: `64 *
            n_layers * n_heads + 35` bytes per document, 17 KB for SmolLM2-135M): what a
            bootstrap over documents reads
            (`cw_lens.reproduction.claims(ablation, Bootstrap(...))`).

    Returns:
        A [`SinkAblationResult`][cw_lens.SinkAblationResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        ablation = cw_lens.sink_ablation(model, corpus, progress=False)
        ablation.summary()   # cone alignment and norms, low-norm heads vs the rest
        ablation.delta_ppl
        ```
    """
    acc = SinkAblationAccumulator(
        model,
        corpus,
        layers=layers,
        heads=heads,
        scale=scale,
        mode=mode,
        sink_positions=sink_positions,
        effect=effect,
        low_norm_quantile=low_norm_quantile,
        batch_size=batch_size,
        prepend_bos=prepend_bos,
        per_document=per_document,
    )
    label = progress and "sink ablation"
    stats, _ = stream_corpus(
        model, corpus, [acc], batch_size=batch_size, prepend_bos=prepend_bos, progress=label
    )
    return acc.finish(stats)


class SinkAblationAccumulator(ConeStatistics):
    """The clean pass of [`sink_ablation`][cw_lens.sink_ablation], and the patched passes its
    `finish` runs.

    Per patched layer and every head `h` of it, over the counted queries `i` (real, not a
    sink, after the row's first sink), float64 sums `[layer, head, statistic]`:
    `norm_before = sum_i ||o_i^h||`, `cone_before = sum_i cos(o_i^h, u^h)`, `count_before`,
    `rel_norm = sum_i ||o_i^h|| / mean_j ||pv_j^h||`, and with `effect="direct"` the same of
    the output with the patch's share of the sink term removed (`norm_after`, `cone_after`,
    `count_after`); plus the clean pass's next-token NLL sums from its logits. `finish` runs
    the patched pass (the patched NLL; with `effect="total"` the patched run's own
    `norm_after`, `cone_after`, `count_after` from the same pass) and builds a
    `SinkAblationResult`: each mean is its sum over its count.

    Args:
        model: The model.
        corpus: The documents.
        layers: Layers to patch (`None` = all).
        heads: Heads to patch (as in `sink_ablation`).
        scale: The patch's `lambda`.
        mode: `"scale"` or `"norm_matched"`.
        sink_positions: The sink positions.
        effect: `"direct"` or `"total"`.
        low_norm_quantile: Share of heads called "low-norm".
        batch_size: Documents per forward pass (of the patched passes run by `finish`).
        prepend_bos: Prepend BOS to text.
        per_document: Also keep each document's sums.

    Examples:
        ```python
        import cw_lens
        from cw_lens.analyses.sinks.ablation import SinkAblationAccumulator

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=4, max_tokens=32, model=model)
        acc = SinkAblationAccumulator(model, corpus, layers=[1])
        results = cw_lens.corpus_analyses(model, corpus, analyses=[acc], progress=False)
        results["ablation"].delta_ppl
        ```
    """

    name = "ablation"

    @check_keywords
    def __init__(
        self,
        model: Model,
        corpus: Any,
        *,
        layers: Any = None,
        heads: Any = None,
        scale: float = 0.0,
        mode: Literal["scale", "norm_matched"] = "scale",
        sink_positions: Sequence[int] = (0,),
        effect: Literal["direct", "total"] = "direct",
        low_norm_quantile: float = 0.25,
        batch_size: int | None = 8,
        prepend_bos: bool = True,
        per_document: bool = False,
    ) -> None:
        if effect not in ("direct", "total"):
            raise InputError(f"effect must be 'direct' or 'total', got {effect!r}.")
        if not 0 < low_norm_quantile < 1:
            raise InputError(f"low_norm_quantile must lie in (0, 1), got {low_norm_quantile}.")
        plan = per_layer_heads(model, layers, heads)
        sinks = SinkSpec(sink_positions)
        check_sinks_inside(model, corpus, sinks.default or (), prepend_bos=prepend_bos)
        self.model, self.corpus, self.effect = model, corpus, effect
        self.low_norm_quantile, self.batch_size = low_norm_quantile, batch_size
        self.prepend_bos, self.sink_positions = prepend_bos, sink_positions
        n_documents = len(as_corpus(corpus)) if per_document else None
        outputs = ("before", "after") if effect == "direct" else ("before",)
        super().__init__(
            plan,
            model.cfg.n_heads,
            sinks,
            outputs,
            need_logits=True,
            scale=scale,
            mode=mode,
            n_documents=n_documents,
            device=model.cfg.device,
        )

    def _patch(self, batch: TokenBatch) -> list:
        """The intervention for one document batch (its mask matters in norm_matched mode)."""
        hook_set = patch_sink(
            self.model,
            heads=self.plan,
            scale=self.scale,
            mode=self.mode,
            sink_positions=self.sink_positions,
            attention_mask=batch.mask,
        )
        return [hook_set]

    def finish(self, stats: Any) -> SinkAblationResult:
        """Run the patched pass and build the result (the sums reach the host once per pass).

        Args:
            stats: The clean pass's `StreamStats`.

        Returns:
            A `SinkAblationResult`.

        Examples:
            ```python
            import cw_lens
            from cw_lens.data.streaming import stream_corpus

            model = cw_lens.load_model("testing:tiny-llama")
            texts = ["The cat sat on the mat.", "Heads look at BOS, mostly."]
            accumulator = cw_lens.SinkAblationAccumulator(model, texts)
            stats, _ = stream_corpus(model, texts, [accumulator])  # update(block) per block
            accumulator.finish(stats).summary()
            ```
        """
        super().finish(stats)
        clean, before = NLLResult(self.nll), self.sums
        recorded = before.per_document is not None
        kw = dict(batch_size=self.batch_size, prepend_bos=self.prepend_bos)
        if self.effect == "direct":
            after = before
            patched = corpus_nll(
                self.model, self.corpus, hooks=self._patch, per_document=recorded, **kw
            )
        else:
            run = ConeStatistics(
                self.plan,
                self.sums.shape[1],
                self.sinks,
                ("after",),
                need_logits=True,
                n_documents=before.per_document.shape[0] if recorded else None,
                device=self.patched.device,
            )
            pass_stats, _ = stream_corpus(
                self.model, self.corpus, [run], fwd_hooks=self._patch, **kw
            )
            after = run.finish(pass_stats).sums
            patched = NLLResult(run.nll)
        self.model = self.corpus = None  # finished: the pass's inputs are not kept
        per_head = _per_head_table(self.plan, before, after, self.low_norm_quantile)
        per_doc = None
        if recorded:
            parts = {name: sums for sums in (before, after) for name in sums.names}
            heads = torch.stack(
                [parts[name].document_table(name) for name in ABLATION_SUMS], 1
            )  # [document, statistic, layer, head]
            nll = torch.cat([clean.document_table(), patched.document_table()], 1)
            per_doc = (heads, nll, self.patched.cpu() > 0)
        return SinkAblationResult(
            clean.mean_nll,
            patched.mean_nll,
            per_head,
            self.scale,
            self.mode,
            self.effect,
            self.layers,
            per_doc,
            self.low_norm_quantile,
        )


def _per_head_table(
    plan: dict[int, list[int]], before: StackedSums, after: StackedSums, low_norm_quantile: float
) -> pd.DataFrame:
    """One row per patched (layer, head) from the summed norms and cone alignments (`before`
    and `after`: the sums `[layer, head, statistic]` of the clean and the patched pass, on the
    host; the same sums for the direct effect): each mean is its sum over its count (at least
    1)."""
    positions = [(i, layer, h) for i, (layer, hs) in enumerate(sorted(plan.items())) for h in hs]
    index = torch.tensor([[i, h] for i, _, h in positions], dtype=torch.long, device="cpu")

    def column(sums: StackedSums, name: str) -> np.ndarray:
        return sums.column(name)[index[:, 0], index[:, 1]].numpy()

    n_before = np.maximum(column(before, "count_before"), 1.0)
    n_after = np.maximum(column(after, "count_after"), 1.0)
    df = pd.DataFrame(
        {
            "layer": [layer for _, layer, _ in positions],
            "head": [h for _, _, h in positions],
            "relative_output_norm": column(before, "rel_norm") / n_before,
            "norm_before": column(before, "norm_before") / n_before,
            "norm_after": column(after, "norm_after") / n_after,
            "cone_before": column(before, "cone_before") / n_before,
            "cone_after": column(after, "cone_after") / n_after,
        }
    )
    cut = df["relative_output_norm"].quantile(low_norm_quantile)
    df["low_norm"] = df["relative_output_norm"] <= cut
    return df
