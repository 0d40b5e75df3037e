r"""Route graphs: the (head, key) paths a prediction comes from (docs/methods.md#flow).

Ferrando & Voita's information-flow routes ("Information Flow Routes: Automatically Interpreting
Language Models at Scale", EMNLP 2024), on cw_lens's residual shares (`cw_lens.flow.shares`).
Node `(l, i)` is the residual stream of position `i` entering block `l` (`(L, i)` the
final stream). Starting at `(L, target)`, from every node `(l+1, i)` reached keep

- the edge `(l, j) -> (l+1, i)` labelled by head `h` when `share(pair h, j) > threshold`
  (`share = <A_i(alpha[i,j]^h pv_j^h), x_{l+1,i}> / ||x_{l+1,i}||^2`),
- the residual edge `(l, i) -> (l+1, i)` when the residual share exceeds it,

and continue from every node reached. MLP and bias shares are node attributes. Each edge carries
its factors, `share = attention * relative_norm * cosine` with `relative_norm =
||A_i(pv_j^h)|| / ||x_{l+1,i}||`. Unlike LLM-TT's proximity scores the shares are exact
projections that sum to 1 per node, and they are computed at forward-pass cost.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.core import flow_geometry as fg
from cw_lens.core.deprecation import keyword_only, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.inputs import one_text, prepare_inputs
from cw_lens.flow.shares import LayerSharesResult, stream_shares
from cw_lens.models.access import Model
from cw_lens.models.verify import require_flow

EDGE_COLUMNS = (
    "layer", "head", "kind", "source", "target", "source_layer", "target_layer",
    "source_token", "target_token", "share", "attention", "relative_norm", "cosine",
)  # fmt: skip
# the per-position pieces of a node's inflow (with the pair shares, they sum to 1)
NODE_PIECES = ("residual", "attention", "mlp", "bias")


class RouteCollector:
    """Consumer of [`stream_shares`][cw_lens.stream_shares] that keeps what routes need.

    Per block: the candidate pair edges (share above the threshold) with their factors — into
    `m_l` on sequential blocks, into `x_{l+1}` on parallel ones — and the per-position
    shares `[batch, layer, pos]` of the pieces entering the half node `m_l` (`half`:
    residual, attention, bias; NaN on parallel blocks) and the node `x_{l+1}` (`full`:
    the residual — `m_l` on sequential blocks, `x_l` on parallel ones —, attention, MLP,
    bias).
    """

    def __init__(self, n_layers: int, threshold: float) -> None:
        self.threshold = threshold
        self.n_layers = n_layers
        self.edges: list[list[Tensor]] = [[] for _ in range(n_layers)]
        self.sequential: list[bool | None] = [None] * n_layers
        self.nodes: dict[str, dict[str, list[list[Tensor]]]] = {
            level: {p: [[] for _ in range(n_layers)] for p in NODE_PIECES}
            for level in ("half", "full")
        }

    def __call__(self, ls: LayerSharesResult) -> None:
        into = ls.into_mid() if ls.sequential else ls
        self.sequential[ls.layer] = ls.sequential
        pairs = into.pairs()
        index = (pairs > self.threshold).nonzero()  # (batch, head, row, key)
        alpha, rel, cos = into.factors(index)
        b, h, q, k = index.unbind(-1)
        share = pairs[b, h, q, k]
        q = q + ls.queries.start
        cols = (b, h, q, k, share, alpha, rel, cos)
        self.edges[ls.layer].append(torch.stack([c.double().cpu() for c in cols], -1))
        if ls.sequential:
            half = {p: getattr(into, p) for p in NODE_PIECES}  # the MLP share is 0 there
            zero = ls.mlp * 0.0  # 0, NaN where the row is undefined
            full = {"residual": ls.mid, "attention": zero, "mlp": ls.mlp, "bias": zero}
        else:
            half = dict.fromkeys(NODE_PIECES, ls.residual * math.nan)
            full = {p: getattr(ls, p) for p in NODE_PIECES}
        for level, pieces in (("half", half), ("full", full)):
            for p, value in pieces.items():
                self.nodes[level][p][ls.layer].append(value.cpu())

    def tables(self) -> tuple[list[Tensor], dict[str, dict[str, Tensor]], list[bool]]:
        """Edges per layer `[n, 8]`, node shares `{level: {piece: [batch, layer, pos]}}`
        and which blocks are sequential."""
        edges = [
            torch.cat(e) if e else torch.zeros(0, 8, dtype=torch.float64, device="cpu")
            for e in self.edges
        ]
        nodes = {
            level: {p: torch.stack([torch.cat(r, 1) for r in rows], 1) for p, rows in d.items()}
            for level, d in self.nodes.items()
        }
        return edges, nodes, [bool(s) for s in self.sequential]


@saveable
@dataclass(repr=False)
class RouteGraphResult(Result):
    """The routes to one target position.

    Attributes:
        graph: `networkx.MultiDiGraph`. Nodes `(layer, position)`: `(l, i)` the stream
            `x_{l,i}` entering block `l` (`l = 0` the embeddings, `l = n_layers` the
            final stream) and, on sequential blocks, the half node `(l + 0.5, i)`, `m_{l,i}`
            (the stream the MLP reads). Node attributes: `token`, `layer`, `position`,
            `half` and (all but the embeddings) the shares of the pieces entering the node,
            `residual`, `attention` (the sum of its pair shares), `mlp` and `bias`, which
            sum to 1. Edges `source -> target` keyed by the head, `"residual"` or `"mlp"`,
            with `layer` (the block), `head` (-1 for residual and MLP edges), `kind`
            (`"attention"`, `"residual"`, `"mlp"`), `share`, the factors
            `attention`, `relative_norm`, `cosine` (NaN for residual and MLP edges) and
            `source_layer` / `target_layer` (the node layers).
        target: The target position; `threshold` the share threshold; `str_tokens` the
            tokens; `n_layers` the number of blocks.
    """

    graph: nx.MultiDiGraph
    target: int
    threshold: float
    str_tokens: list[str]
    n_layers: int
    model_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy edges: one row per edge.

        Returns:
            A DataFrame with the columns `EDGE_COLUMNS` (source/target positions, layers, kind,
            share and its factors).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            graph.to_dataframe().head()
            ```
        """
        rows = []
        for (lj, j), (li, i), data in self.graph.edges(data=True):
            rows.append(
                {
                    **{c: data[c] for c in ("layer", "head", "kind", "share")},
                    **{c: data[c] for c in ("attention", "relative_norm", "cosine")},
                    "source": j,
                    "target": i,
                    "source_layer": lj,
                    "target_layer": li,
                    "source_token": self.str_tokens[j],
                    "target_token": self.str_tokens[i],
                }
            )
        df = pd.DataFrame(rows, columns=list(EDGE_COLUMNS))
        order = ["target_layer", "target", "kind", "head", "source"]
        return df.sort_values(order).reset_index(drop=True)

    @renamed_kwargs(kind="edge")
    def top(self, k: int = 10, *, edge: str | None = "attention") -> pd.DataFrame:
        """The `k` edges with the largest share, of one edge type.

        Args:
            k: How many edges.
            edge: `"attention"`, `"residual"` or `"mlp"`; `None`: all.

        Returns:
            `k` rows of [`to_dataframe`][cw_lens.RouteGraphResult.to_dataframe], largest first.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            graph.top(5)
            graph.top(5, edge=None)
            ```
        """
        df = self.to_dataframe()
        if edge is not None:
            df = df[df["kind"] == edge]
        return df.sort_values("share", ascending=False).head(k).reset_index(drop=True)

    def reaches(self, position: int) -> bool:
        """Whether any node at `position` lies on a route.

        Args:
            position: A token position.

        Returns:
            True when a route passes through the position.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            graph.reaches(0)
            ```
        """
        return any(p == position for _, p in self.graph.nodes)

    def routes_from(self, node: tuple[float, int]) -> RouteGraphResult:
        """The routes that start at `node`: the subgraph of the nodes reachable from it.

        Args:
            node: `(sub-layer, position)`, e.g. `(0, i)`: token `i`'s embedding.

        Returns:
            A [`RouteGraphResult`][cw_lens.RouteGraphResult] (all its routes lead to the target);
            empty when `node` is not on a route.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            sub = graph.routes_from((0, 1))
            len(sub.to_dataframe())
            ```
        """
        keep = nx.descendants(self.graph, node) | {node} if node in self.graph else set()
        sub = self.graph.subgraph(keep).copy()
        return RouteGraphResult(sub, self.target, self.threshold, self.str_tokens, self.n_layers,
                          self.model_name, dict(self.meta))  # fmt: skip

    def mlps(self) -> pd.DataFrame:
        """MLP edges on the routes.

        Returns:
            A DataFrame with `layer, position, token, share`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            graph.mlps()
            ```
        """
        df = self.to_dataframe()
        df = df[df["kind"] == "mlp"]
        out = df[["layer", "target", "target_token", "share"]]
        return out.rename(columns={"target": "position", "target_token": "token"}).reset_index(
            drop=True
        )

    def heads(self) -> pd.DataFrame:
        """Attention edges per (layer, head).

        Returns:
            A DataFrame with the count and the summed share per head.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            graph.heads()
            ```
        """
        df = self.to_dataframe()
        df = df[df["kind"] == "attention"]
        return (
            df.groupby(["layer", "head"])["share"]
            .agg(edges="count", share="sum")
            .sort_values("share", ascending=False)
            .reset_index()
        )

    def plot(self, **kwargs: Any) -> Any:
        """The routes over layers x positions (matplotlib).

        Args:
            **kwargs: Passed to `cw_lens.plots.flow.plot_routes` (`figsize`, `max_labels`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            fig = graph.plot()
            ```
        """
        from cw_lens.plots import plot_routes

        return plot_routes(self, **kwargs)

    def panel_data(self) -> dict[str, Any]:
        """A JSON-able description for the interactive panel.

        Returns:
            A dict with the nodes and the edges (with their factors).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            sorted(graph.panel_data())
            ```
        """
        nodes = [
            {
                "layer": _num(layer),
                "position": int(pos),
                "half": bool(data.get("half", False)),
                **{k: _num(v) for k, v in data.items() if k in NODE_PIECES},
            }
            for (layer, pos), data in sorted(self.graph.nodes(data=True))
        ]
        edges = self.to_dataframe().drop(columns=["source_token", "target_token"])
        return {
            "model": self.model_name,
            "tokens": list(self.str_tokens),
            "n_layers": self.n_layers,
            "target": self.target,
            "threshold": self.threshold,
            "nodes": nodes,
            "edges": [{k: _num(v) for k, v in row.items()} for row in edges.to_dict("records")],
        }

    def to_html(self, path: Any = None) -> str:
        """A self-contained interactive HTML panel (it opens from disk, no server).

        Args:
            path: Write the page to this file when given.

        Returns:
            The page, as a string.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
            html = graph.to_html("routes.html")
            ```
        """
        from cw_lens.viz.routes import routes_html

        html = routes_html(self.panel_data())
        if path is not None:
            from pathlib import Path

            Path(path).write_text(html, encoding="utf-8")
        return html


def _num(v: Any) -> Any:
    """JSON-safe scalars: NaN -> None, numpy -> Python."""
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else round(float(v), 6)
    return v


def _step(
    source: float, target: float, layer: int, pairs: Tensor, same: dict, pieces: dict
) -> dict[str, Any]:
    return {"source": source, "target": target, "layer": layer, "pairs": pairs, "same": same,
            "pieces": pieces}  # fmt: skip


def _route_steps(
    per_layer: list[Tensor], nodes: dict[str, dict[str, Tensor]], sequential: list[bool], row: int
) -> list[dict[str, Any]]:
    """The steps of the route graph of one batch row, from the embeddings up (methods §
    Contribution flow):
    `x_l -> m_l` and `m_l -> x_{l+1}` per sequential block, `x_l -> x_{l+1}` per
    parallel one. Each: source/target node layer, block, pair edges, same-position shares and
    the node attributes of its target level."""
    steps = []
    for layer, seq in enumerate(sequential):
        full = {p: v[row, layer] for p, v in nodes["full"].items()}
        up = {"residual": full["residual"], "mlp": full["mlp"]}
        if seq:
            half = {p: v[row, layer] for p, v in nodes["half"].items()}
            first = {"residual": half["residual"]}
            steps.append(_step(layer, layer + 0.5, layer, per_layer[layer], first, half))
            steps.append(_step(layer + 0.5, layer + 1, layer, per_layer[layer][:0], up, full))
        else:
            steps.append(_step(layer, layer + 1, layer, per_layer[layer], up, full))
    return steps


def build_route_graph(
    edges: list[Tensor],
    nodes: dict[str, dict[str, Tensor]],
    sequential: list[bool],
    row: int,
    target: int,
    threshold: float,
    str_tokens: list[str],
    model_name: str = "",
) -> RouteGraphResult:
    """Trace the routes of one batch row from the collected candidates (docs/methods.md#flow)."""
    n_layers, n_pos = len(edges), nodes["full"]["residual"].shape[-1]
    per_layer = [e[e[:, 0] == row] for e in edges]
    steps = _route_steps(per_layer, nodes, sequential, row)
    index = [
        ((st["pairs"][:, 2].long(), st["pairs"][:, 3].long()),
         [share > threshold for share in st["same"].values()])
        for st in steps
    ]  # fmt: skip
    kept, reached = fg.trace_routes(index, n_pos, target)
    levels = [0] + [st["target"] for st in steps]
    g = nx.MultiDiGraph()
    for level, pos in reached.nonzero().tolist():
        layer = levels[level]
        attrs = {"layer": layer, "position": pos, "token": str_tokens[pos],
                 "half": not float(layer).is_integer()}  # fmt: skip
        if level > 0:
            attrs.update({p: float(v[pos]) for p, v in steps[level - 1]["pieces"].items()})
        g.add_node((layer, pos), **attrs)
    nan = float("nan")
    for s, st in enumerate(steps):
        common = {"layer": st["layer"], "source_layer": st["source"], "target_layer": st["target"]}
        for _, h, i, j, share, alpha, rel, cos in st["pairs"][kept[s]].tolist():
            g.add_edge(
                (st["source"], int(j)), (st["target"], int(i)), key=int(h), head=int(h),
                kind="attention", share=share, attention=alpha, relative_norm=rel, cosine=cos,
                **common,
            )  # fmt: skip
        for kind, share in st["same"].items():
            for i in (reached[s + 1] & (share > threshold)).nonzero().flatten().tolist():
                g.add_edge(
                    (st["source"], i), (st["target"], i), key=kind, head=-1, kind=kind,
                    share=float(share[i]), attention=nan, relative_norm=nan, cosine=nan,
                    **common,
                )  # fmt: skip
    return RouteGraphResult(g, target, threshold, str_tokens, n_layers, model_name)


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be a number, got {threshold!r}.")
    if not 0.0 <= float(threshold) < 1.0:
        raise InputError(
            f"threshold must lie in [0, 1) (a share of the residual stream), got {threshold}."
        )
    return float(threshold)


@check_keywords
@renamed_kwargs(text="inputs")
@keyword_only("target", "threshold")
def routes(
    model: Model,
    inputs: Any,
    *,
    target: int = -1,
    threshold: float = 0.02,
    prepend_bos: bool = True,
    query_chunk: int | None = None,
) -> RouteGraphResult:
    """The route graph of one text, traced back from position `target`.

    Args:
        model: A `TransformerBridge`.
        inputs: One text: a string, or its token ids (`[pos]`, `[1, pos]`, a list of ids),
            or a corpus of one document; `text=` is its deprecated name.
        target: The position whose final stream to explain (negative counts from the end).
        threshold: Keep edges whose share exceeds this (a fraction of the receiving stream).
        prepend_bos: Prepend BOS to text.
        query_chunk: Query rows per streamed block (`None`: automatic).

    Returns:
        A [`RouteGraphResult`][cw_lens.RouteGraphResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        graph = cw_lens.routes(model, "The cat sat on the mat.", threshold=0.05)
        graph.top(5)     # the largest attention edges on the routes
        fig = graph.plot()
        ```
    """
    require_flow(model)
    threshold = check_threshold(threshold)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos)
    one_text("routes", batch.tokens.shape[0], " (for IOI items: ioi_route_statistics)")
    n = int(batch.lengths[0])
    if isinstance(target, bool) or not isinstance(target, int) or not -n <= target < n:
        raise InputError(f"target must be a position in {-n}..{n - 1}, got {target!r}.")
    collector = RouteCollector(model.cfg.n_layers, threshold)
    stream_shares(
        model,
        batch.tokens,
        collector,
        query_chunk=query_chunk,
        batch_size=None,
        progress=False,
        reuse_buffers=True,  # reduced inside the call
    )
    edges, nodes, sequential = collector.tables()
    return build_route_graph(
        edges,
        nodes,
        sequential,
        0,
        target % n,
        threshold,
        batch.str_tokens(model)[0],
        str(getattr(model.cfg, "model_name", "")),
    )
