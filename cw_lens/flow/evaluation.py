r"""Testing contribution flow against the model: a rollout deletion test and IOI route statistics.

**Deletion test** ([`rollout_deletion`][cw_lens.rollout_deletion]; the comprehensiveness test of
DeYoung et al. 2020 applied to rollouts, as in Abnar & Zuidema 2020's "blank-out" comparison). For
every item a target position `t` and its target token(s): on text, `t` is the second-to-last
position and the target is the last token (next-token prediction); on task items `t` is the last
prompt position and the target is the answer (teacher-forced over its tokens). The input tokens
`j < t` are ranked by each rollout's row `R[t, j]` — contribution rollout, attention
rollout, and seeded random rankings as the control — and the top `k` are **deleted as keys in
every layer and head** (their attention probabilities set to 0 for every query, without
renormalising: [`cw_lens.mask_attention`][cw_lens.mask_attention]). The measure is the drop of the
    target's
log-probability, `log p_clean - log p_deleted` (larger = the ranking found tokens the
prediction needs). The target position's own token stays (it lives in its residual stream, so
key masking cannot remove it); BOS is a candidate unless `exclude_bos=True`.

**IOI routes** ([`ioi_route_statistics`][cw_lens.ioi_route_statistics]): for indirect-object items
("When Mary and John went to the store, John gave a drink to" -> " Mary"), the route graph
([`cw_lens.routes`][cw_lens.routes]) from the last prompt position; how often it reaches the
indirect object's token (at any layer, and at the embedding), the subject's tokens as a control, and
which heads carry the edges that leave the indirect object's position.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from cw_lens.analyses.faithfulness import rank_candidates
from cw_lens.core.deprecation import keyword_only
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.documents import Corpus, as_corpus
from cw_lens.data.inputs import TokenBatch, answer_spans, iter_batches, prepare_inputs
from cw_lens.data.scoring import run_logits, score_answers
from cw_lens.flow.rollout import METHODS, rollout_batches
from cw_lens.flow.routes import RouteCollector, build_route_graph, check_threshold
from cw_lens.flow.shares import stream_shares
from cw_lens.models.access import Model
from cw_lens.models.interventions import mask_attention
from cw_lens.models.verify import require_flow

DEFAULT_KS = (1, 2, 4, 8)


# --------------------------------------------------------------------------- items


def target_items(model: Any, corpus: Any) -> tuple[TokenBatch, list[tuple[int, int]], str]:
    """The batch, the target span `[start, end)` per row (predicted from `start - 1`) and
    the corpus name: task items score their answer, text its last token."""
    docs = as_corpus(corpus)
    if docs.is_task:
        batch, spans = answer_spans(model, list(docs))
        return batch, spans, docs.name
    batch = prepare_inputs(model, docs)
    lengths = batch.lengths.tolist()
    if min(lengths) < 3:
        raise InputError(
            "Every text needs at least 3 tokens (a context token, the target position and the "
            "next token it predicts)."
        )
    return batch, [(n - 1, n) for n in lengths], docs.name


def _seed(*parts: Any) -> int:
    key = "/".join(str(p) for p in parts).encode()
    return int(hashlib.sha1(key).hexdigest()[:12], 16)


# --------------------------------------------------------------------------- deletion test


@saveable
@dataclass(repr=False)
class RolloutDeletionResult(Result):
    """Outcome of the deletion test: one record per (item, ranking, draw, k).

    `records` columns: `item, method, draw, k, n_candidates, clean_logprob, logprob, drop`
    (`drop = clean_logprob - logprob`; NaN when the item has fewer than `k` candidates).
    """

    records: pd.DataFrame
    corpus: str
    ks: list[int]
    exclude_bos: bool
    n_random: int

    def to_dataframe(self) -> pd.DataFrame:
        """One record per (item, ranking, draw, k).

        Returns:
            The records as a DataFrame (the target's log-probability drop per deletion).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
            deletion.to_dataframe().head()
            ```
        """
        return self.records

    def summary(self) -> pd.DataFrame:
        """Mean drop per ranking and k (random: over items and draws).

        Returns:
            A DataFrame with the mean drop, its standard error and the number of items.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
            deletion.summary()
            ```
        """
        df = self.records.dropna(subset=["drop"])
        per_item = df.groupby(["method", "k", "item"])["drop"].mean().reset_index()
        g = per_item.groupby(["method", "k"])["drop"]
        out = g.agg(mean_drop="mean", sem="sem", n_items="count").reset_index()
        return out.sort_values(["method", "k"]).reset_index(drop=True)

    def aopc(self) -> pd.Series:
        """Area over the perturbation curve: the mean drop averaged over the ks.

        Returns:
            A Series indexed by ranking.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
            deletion.aopc()
            ```
        """
        return self.summary().groupby("method")["mean_drop"].mean()

    def wins(self, a: str = "contribution", b: str = "attention") -> pd.Series:
        """Per k, the share of items where ranking `a` deletes a larger drop than `b`.

        Args:
            a: A ranking (`"contribution"`, `"attention"`, `"random"`).
            b: The ranking it is compared with.

        Returns:
            A Series indexed by k.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
            deletion.wins("contribution", "attention")
            ```
        """
        df = self.records.dropna(subset=["drop"])
        piv = df.groupby(["k", "item", "method"])["drop"].mean().unstack("method")
        piv = piv.dropna(subset=[a, b])
        return (piv[a] > piv[b]).groupby("k").mean()

    def top(self, k: int = 10) -> pd.DataFrame:
        """The rankings by AOPC (largest first).

        Args:
            k: How many rankings.

        Returns:
            A DataFrame with one row per ranking.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
            deletion.top()
            ```
        """
        return self.aopc().sort_values(ascending=False).head(k).rename("aopc").reset_index()

    def plot(self, **kwargs: Any) -> Any:
        """The mean drop against k, per ranking.

        Args:
            **kwargs: Passed to `cw_lens.plots.flow.plot_rollout_deletion` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
            deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
            fig = deletion.plot()
            ```
        """
        from cw_lens.plots import plot_rollout_deletion

        return plot_rollout_deletion(self, **kwargs)


def _rankings(
    rows: dict[str, Tensor], targets: Tensor, width: int, n_random: int, docs: list[int],
    seed: int, exclude_bos: bool,
) -> tuple[dict[tuple[str, int], Tensor], Tensor]:  # fmt: skip
    """Rank of every key per row for each (method, draw); and the candidate mask."""
    pos = torch.arange(width, device="cpu")
    valid = pos[None, :] < targets[:, None]
    if exclude_bos:
        valid &= pos[None, :] > 0
    ranks = {(m, 0): rank_candidates(rows[m], valid, signed=True) for m in METHODS}
    for d in range(n_random):
        scores = torch.stack(
            [torch.rand(width, generator=torch.Generator().manual_seed(_seed(seed, doc, d)),
                        device="cpu")
             for doc in docs]
        )  # fmt: skip
        ranks[("random", d)] = rank_candidates(scores, valid, signed=True)
    return ranks, valid


@check_keywords
def rollout_deletion(
    model: Model,
    corpus: Any,
    *,
    ks: Sequence[int] = DEFAULT_KS,
    n_random: int = 5,
    exclude_bos: bool = False,
    seed: int = 0,
    batch_size: int | None = 16,
) -> RolloutDeletionResult:
    """Delete the top-k input tokens by each rollout and measure the target's log-prob drop.

    Args:
        model: A `TransformerBridge`.
        corpus: Task items (`load_corpus("ioi", ...)`: the answer is the target) or texts
            (the last token is the target, predicted from the position before it).
        ks: Numbers of deleted tokens.
        n_random: Random rankings (the control), each seeded per item. Default 5: each
            ranking costs `len(ks)` forward passes per batch of short items, so five draws
            (2.5 times the passes of the two rollouts) average the control cheaply.
        exclude_bos: Keep position 0 out of the candidates.
        seed: Seed of the random rankings.
        batch_size: Items per forward pass.

    Returns:
        A [`RolloutDeletionResult`][cw_lens.RolloutDeletionResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        deletion = cw_lens.rollout_deletion(model, corpus, ks=(1, 2), n_random=2)
        deletion.aopc()    # contribution vs attention vs random rollout
        ```
    """
    require_flow(model)
    if isinstance(n_random, bool) or not isinstance(n_random, int) or n_random < 0:
        raise InputError(f"n_random must be a non-negative integer, got {n_random!r}.")
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise InputError(f"ks must be positive token counts, got {ks}.")
    batch, spans, name = target_items(model, corpus)
    layers = range(model.cfg.n_layers)
    records = []
    for sub, contribution, attention, logits in rollout_batches(
        model, batch, batch_size, need_logits=True
    ):
        sub_spans = [spans[d] for d in sub.documents]
        targets = torch.tensor([s - 1 for s, _ in sub_spans], device="cpu")
        rows_idx = torch.arange(len(targets), device="cpu")
        rows = {
            "contribution": contribution.cpu()[rows_idx, targets],
            "attention": attention.cpu()[rows_idx, targets],
        }
        clean = score_answers(logits, sub.tokens, sub_spans).logprob
        width = sub.tokens.shape[1]
        ranks, valid = _rankings(rows, targets, width, n_random, sub.documents, seed, exclude_bos)
        n_cand = valid.sum(-1)
        for (method, draw), rank in ranks.items():
            for k in ks:
                delete = (rank < k) & valid & (n_cand >= k)[:, None]
                masks = {layer: delete[:, None, None, :] for layer in layers}
                with mask_attention(model, masks):
                    deleted = score_answers(run_logits(model, sub), sub.tokens, sub_spans)
                for r, doc in enumerate(sub.documents):
                    ok = int(n_cand[r]) >= k
                    lp = float(deleted.logprob[r]) if ok else math.nan
                    records.append(
                        (doc, method, draw, k, int(n_cand[r]), float(clean[r]), lp,
                         float(clean[r]) - lp)
                    )  # fmt: skip
    cols = ["item", "method", "draw", "k", "n_candidates", "clean_logprob", "logprob", "drop"]
    return RolloutDeletionResult(
        pd.DataFrame(records, columns=cols), name, ks, exclude_bos, n_random
    )


# --------------------------------------------------------------------------- IOI routes


def word_positions(model: Any, text: str, word: str, prepend_bos: bool = True) -> list[int]:
    """Token positions where the word `word` starts in `text` (BOS counted when prepended)."""
    tok = model.tokenizer
    if tok is None or not getattr(tok, "is_fast", False):
        raise InputError("Locating names needs a fast tokenizer with offset mappings.")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    shift = int(prepend_bos and tok.bos_token_id is not None)
    out = []
    for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text):
        c = m.start()
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            if start <= c < end:
                out.append(t + shift)
                break
    return out


@saveable
@dataclass(repr=False)
class IOIRouteStatisticsResult(Result):
    """Routes from the answer position of IOI items.

    `items`: one row per item — `target`, `io` (the indirect object's token position),
    `s1`/`s2` (the subject's), `reaches_io` (any node at the IO position),
    `reaches_io_embedding` (node `(0, io)`, the IO token's embedding), `reaches_s1`,
    `reaches_s2`, `io_into_target` / `s_into_target` (an attention edge from the IO / a
    subject position straight into the target), `n_edges` (attention edges), `n_mlp_edges`,
    `io_heads` (the `(layer, head)` of edges leaving the IO position), `io_target_heads`
    (of edges from the IO position into the target), `io_embedding_heads` (of the attention
    edges between positions on the routes that start at the IO embedding) and
    `io_embedding_mlps` (the `(layer, position)` of the MLP edges on those routes).
    `heads`: per (layer, head), the number of items whose route uses it to move information
    out of the IO position (`io_items`), from the IO position straight into the target
    (`io_target_items`), into the target from anywhere (`target_items`) and on a route
    from the IO embedding (`io_embedding_items`). `mlps`: per (layer, `where` — `"io"`,
    `"target"` or `"other"` position), the number of items whose routes from the IO
    embedding pass that MLP (`io_embedding_items`).
    """

    items: pd.DataFrame
    heads: pd.DataFrame
    threshold: float
    mlps: pd.DataFrame | None = None

    def to_dataframe(self) -> pd.DataFrame:
        """One row per IOI item: where its routes go.

        Returns:
            The per-item table as a DataFrame.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            ioi = cw_lens.load_corpus("ioi", n_docs=4, model=model)
            stats = cw_lens.ioi_route_statistics(model, ioi)
            stats.to_dataframe().head()
            ```
        """
        return self.items

    def summary_dict(self) -> dict[str, float]:
        """Headline numbers: the shares of items whose routes reach the indirect object.

        Returns:
            A dict of floats (`summary()`: as a one-row DataFrame).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            ioi = cw_lens.load_corpus("ioi", n_docs=4, model=model)
            stats = cw_lens.ioi_route_statistics(model, ioi)
            stats.summary_dict()
            ```
        """
        df = self.items
        return {
            "n_items": len(df),
            "threshold": self.threshold,
            "reaches_io": float(df["reaches_io"].mean()),
            "reaches_io_embedding": float(df["reaches_io_embedding"].mean()),
            "reaches_s1": float(df["reaches_s1"].mean()),
            "reaches_s2": float(df["reaches_s2"].mean()),
            "io_into_target": float(df["io_into_target"].mean()),
            "s_into_target": float(df["s_into_target"].mean()),
            "mean_edges": float(df["n_edges"].mean()),
            "mean_mlp_edges": float(df["n_mlp_edges"].mean()),
        }

    @keyword_only("by")
    def top(self, k: int = 10, *, by: str = "io_items") -> pd.DataFrame:
        """The heads that most often carry the indirect object (or enter the target).

        Args:
            k: How many heads.
            by: The column to rank by (`"io_items"`: items whose IO route passes the head).

        Returns:
            `k` rows of the per-head table, largest first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            ioi = cw_lens.load_corpus("ioi", n_docs=4, model=model)
            stats = cw_lens.ioi_route_statistics(model, ioi)
            stats.top(5)
            ```
        """
        return self.heads.sort_values(by, ascending=False).head(k).reset_index(drop=True)


def _heads(g: Any, *, source: int | None = None, target: int | None = None) -> list:
    """Sorted `(layer, head)` of the attention edges on the routes from `source` (to
    another position) and/or into `target` (neither: every edge between two positions)."""
    out = set()
    for (_, j), (_, i), data in g.graph.edges(data=True):
        if data["kind"] != "attention" or (source is None and target is None and i == j):
            continue
        if source is not None and (j != source or i == source):
            continue
        if target is not None and i != target:
            continue
        out.add((int(data["layer"]), int(data["head"])))
    return sorted(out)


def _mlps(g: Any) -> list[tuple[int, int]]:
    """Sorted `(layer, position)` of the MLP edges on the routes."""
    edges = g.graph.edges(data=True)
    return sorted((int(d["layer"]), int(i)) for _, (_, i), d in edges if d["kind"] == "mlp")


def _item_row(g: Any, doc: int, text: str, target: int, io: int, subj: list[int]) -> dict:
    from_io = g.routes_from((0, io))
    att = g.to_dataframe()
    att = att[att["kind"] == "attention"]
    into = set(att.loc[att["target"] == target, "source"])
    return {
        "item": doc,
        "text": text,
        "target": target,
        "io": io,
        "s1": subj[0],
        "s2": subj[1],
        "reaches_io": g.reaches(io),
        "reaches_io_embedding": (0, io) in g.graph,
        "reaches_s1": g.reaches(subj[0]),
        "reaches_s2": g.reaches(subj[1]),
        "io_into_target": io in into,
        "s_into_target": bool(into & set(subj)),
        "n_edges": len(att),
        "n_mlp_edges": int((g.to_dataframe()["kind"] == "mlp").sum()),
        "io_heads": _heads(g, source=io),
        "io_target_heads": _heads(g, source=io, target=target),
        "io_embedding_heads": _heads(from_io),
        "io_embedding_mlps": _mlps(from_io),
    }


@check_keywords
def ioi_route_statistics(
    model: Model, corpus: Any, *, threshold: float = 0.02, batch_size: int | None = 16
) -> IOIRouteStatisticsResult:
    """Route graphs of IOI items from the answer position, and where they go.

    Args:
        model: A `TransformerBridge`.
        corpus: IOI items (`cw_lens.load_corpus("ioi", model=model, only_correct=True)`).
        threshold: The route threshold (see [`cw_lens.routes`][cw_lens.routes]).
        batch_size: Items per forward pass.

    Returns:
        An [`IOIRouteStatisticsResult`][cw_lens.IOIRouteStatisticsResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        ioi = cw_lens.load_corpus("ioi", n_docs=4, model=model)
        stats = cw_lens.ioi_route_statistics(model, ioi)
        stats.summary_dict()
        ```
    """
    require_flow(model)
    threshold = check_threshold(threshold)
    docs = as_corpus(corpus)
    if not all((d.meta or {}).get("task") == "ioi" for d in docs):
        raise InputError(
            "ioi_route_statistics needs IOI items, which carry their answer and names (texts and "
            "token ids do not): cw_lens.load_corpus('ioi', model=model)."
        )
    prompts = Corpus(docs.name, [type(d)(d.text) for d in docs])
    batch = prepare_inputs(model, prompts)
    tokens = batch.str_tokens(model)
    rows, head_rows, mlp_rows = [], [], []
    for sub in iter_batches(batch, batch_size):
        collector = RouteCollector(model.cfg.n_layers, threshold)
        stream_shares(
            model,
            sub.tokens,
            collector,
            attention_mask=sub.mask.long(),
            batch_size=None,
            progress=False,
            reuse_buffers=True,  # reduced inside the call
        )
        edges, nodes, sequential = collector.tables()
        for r, doc in enumerate(sub.documents):
            d = docs[doc]
            io = word_positions(model, d.text, d.answer.strip())
            subj = word_positions(model, d.text, d.meta["subject"])
            if len(io) != 1 or len(subj) != 2:
                raise InputError(
                    f"Item {doc}: expected the indirect object once and the subject twice in "
                    f"{d.text!r} (found positions {io} and {subj})."
                )
            target = int(sub.lengths[r]) - 1
            g = build_route_graph(edges, nodes, sequential, r, target, threshold, tokens[doc])
            rows.append(_item_row(g, doc, d.text, target, io[0], subj))
            for what, heads in (
                ("io", rows[-1]["io_heads"]),
                ("io_target", rows[-1]["io_target_heads"]),
                ("target", _heads(g, target=target)),
                ("io_embedding", rows[-1]["io_embedding_heads"]),
            ):
                head_rows += [(doc, layer, head, what) for layer, head in heads]
            where = {io[0]: "io", target: "target"}
            mlps = rows[-1]["io_embedding_mlps"]
            mlp_rows += sorted({(doc, layer, where.get(pos, "other")) for layer, pos in mlps})
    hr = pd.DataFrame(head_rows, columns=["item", "layer", "head", "what"])
    counts = {f"{w}_items": hr["what"] == w for w in ("io", "io_target", "target", "io_embedding")}
    heads = hr.assign(**counts).groupby(["layer", "head"])[list(counts)].sum().reset_index()
    mr = pd.DataFrame(mlp_rows, columns=["item", "layer", "where"])
    mlps = mr.groupby(["layer", "where"]).size().rename("io_embedding_items").reset_index()
    items = pd.DataFrame(rows).sort_values("item").reset_index(drop=True)
    return IOIRouteStatisticsResult(items, heads, threshold, mlps)
