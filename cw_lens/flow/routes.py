r"""Route graphs: the (head, key) paths a prediction comes from (SPEC §7).

Ferrando & Voita's information-flow routes ("Information Flow Routes: Automatically Interpreting
Language Models at Scale", EMNLP 2024), on cw_lens's residual shares (:mod:`cw_lens.flow.shares`).
Node ``(l, i)`` is the residual stream of position ``i`` entering block ``l`` (``(L, i)`` the
final stream). Starting at ``(L, target)``, from every node ``(l+1, i)`` reached keep

- the edge ``(l, j) -> (l+1, i)`` labelled by head ``h`` when ``share(pair h, j) > threshold``
  (``share = <A_i(alpha[i,j]^h pv_j^h), x_{l+1,i}> / ||x_{l+1,i}||^2``),
- the residual edge ``(l, i) -> (l+1, i)`` when the residual share exceeds it,

and continue from every node reached. MLP and bias shares are node attributes. Each edge carries
its factors, ``share = attention * relative_norm * cosine`` with ``relative_norm =
||A_i(pv_j^h)|| / ||x_{l+1,i}||``. Unlike LLM-TT's proximity scores the shares are exact
projections that sum to 1 per node, and they are computed at forward-pass cost.

Example::

    import cw_lens
    model = cw_lens.load_model()
    g = cw_lens.routes(model, "When Mary and John went to the store, John gave a drink to",
                       threshold=0.02)
    g.graph                    # networkx MultiDiGraph: nodes (layer, position), edges keyed by head
    g.top(k=10)                # the strongest attention edges on the routes
    g.plot()                   # the routes over layers x positions
    g.to_html("routes.html")   # interactive panel: hover an edge for its head, share and factors
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import pandas as pd
import torch
from torch import Tensor

from cw_lens.core.deprecation import keyword_only, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.results import Result
from cw_lens.data.inputs import prepare_inputs
from cw_lens.flow import geometry as fg
from cw_lens.flow.shares import LayerShares, stream_shares
from cw_lens.models.verify import require_verified

EDGE_COLUMNS = (
    "layer", "head", "kind", "source", "target", "source_token", "target_token",
    "share", "attention", "relative_norm", "cosine",
)  # fmt: skip


class RouteCollector:
    """Consumer of :func:`~cw_lens.flow.shares.stream_shares` that keeps what routes need.

    Per block: the candidate pair edges (share above the threshold) with their factors, and
    the residual / MLP / bias shares of every position ``[batch, layer, pos]``.
    """

    def __init__(self, n_layers: int, threshold: float) -> None:
        self.threshold = threshold
        self.n_layers = n_layers
        self.edges: list[list[Tensor]] = [[] for _ in range(n_layers)]
        self.nodes: dict[str, list[list[Tensor]]] = {
            p: [[] for _ in range(n_layers)] for p in ("residual", "mlp", "bias")
        }

    def __call__(self, ls: LayerShares) -> None:
        pairs = ls.pairs()
        index = (pairs > self.threshold).nonzero()  # (batch, head, row, key)
        alpha, rel, cos = ls.factors(index)
        b, h, q, k = index.unbind(-1)
        share = pairs[b, h, q, k]
        q = q + ls.queries.start
        cols = (b, h, q, k, share, alpha, rel, cos)
        self.edges[ls.layer].append(torch.stack([c.double().cpu() for c in cols], -1))
        for p, rows in self.nodes.items():
            rows[ls.layer].append(getattr(ls, p).cpu())

    def tables(self) -> tuple[list[Tensor], dict[str, Tensor]]:
        """Edges per layer ``[n, 8]`` and node shares ``{piece: [batch, layer, pos]}``."""
        edges = [torch.cat(e) if e else torch.zeros(0, 8, dtype=torch.float64) for e in self.edges]
        nodes = {
            p: torch.stack([torch.cat(r, 1) for r in rows], 1) for p, rows in self.nodes.items()
        }
        return edges, nodes


@dataclass(repr=False)
class RouteGraph(Result):
    """The routes to one target position.

    Attributes:
        graph: ``networkx.MultiDiGraph``; nodes ``(layer, position)`` with ``token``,
            ``layer``, ``position`` and (for ``layer >= 1``) the ``mlp``, ``bias`` and
            ``residual`` shares of the block that produced the node; edges
            ``(layer, j) -> (layer + 1, i)`` keyed by the head (``"residual"`` for residual
            edges) with ``layer``, ``head`` (-1 for residual), ``kind``, ``share`` and the
            factors ``attention``, ``relative_norm``, ``cosine`` (NaN for residual edges).
        target: The target position; ``threshold`` the share threshold; ``str_tokens`` the
            tokens; ``n_layers`` the number of blocks.
    """

    graph: nx.MultiDiGraph
    target: int
    threshold: float
    str_tokens: list[str]
    n_layers: int
    model_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy edges: one row per edge, columns ``EDGE_COLUMNS`` (source/target positions)."""
        rows = []
        for (_, j), (_, i), data in self.graph.edges(data=True):
            rows.append(
                {
                    **{c: data[c] for c in ("layer", "head", "kind", "share")},
                    **{c: data[c] for c in ("attention", "relative_norm", "cosine")},
                    "source": j,
                    "target": i,
                    "source_token": self.str_tokens[j],
                    "target_token": self.str_tokens[i],
                }
            )
        df = pd.DataFrame(rows, columns=list(EDGE_COLUMNS))
        return df.sort_values(["layer", "target", "head", "source"]).reset_index(drop=True)

    @renamed_kwargs(kind="edge")
    def top(self, k: int = 10, *, edge: str | None = "attention") -> pd.DataFrame:
        """The ``k`` edges with the largest share, of one ``edge`` type (``"attention"`` or
        ``"residual"``; ``None``: both)."""
        df = self.to_dataframe()
        if edge is not None:
            df = df[df["kind"] == edge]
        return df.sort_values("share", ascending=False).head(k).reset_index(drop=True)

    def reaches(self, position: int) -> bool:
        """Whether any node at ``position`` lies on a route."""
        return any(p == position for _, p in self.graph.nodes)

    def heads(self) -> pd.DataFrame:
        """Attention edges per (layer, head): count and summed share."""
        df = self.to_dataframe()
        df = df[df["kind"] == "attention"]
        return (
            df.groupby(["layer", "head"])["share"]
            .agg(edges="count", share="sum")
            .sort_values("share", ascending=False)
            .reset_index()
        )

    def plot(self, **kwargs: Any):
        """The routes over layers x positions (matplotlib); a Figure."""
        from cw_lens.plots import plot_routes

        return plot_routes(self, **kwargs)

    def panel_data(self) -> dict[str, Any]:
        """A JSON-able description for the interactive panel (nodes, edges with factors)."""
        nodes = [
            {
                "layer": int(layer),
                "position": int(pos),
                **{k: _num(v) for k, v in data.items() if k in ("mlp", "bias", "residual")},
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
        """A self-contained interactive HTML panel; written to ``path`` when given."""
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


def build_route_graph(
    edges: list[Tensor],
    nodes: dict[str, Tensor],
    row: int,
    target: int,
    threshold: float,
    str_tokens: list[str],
    model_name: str = "",
) -> RouteGraph:
    """Trace the routes of one batch row from the collected candidates (SPEC §7)."""
    n_layers = len(edges)
    per_layer = [e[e[:, 0] == row] for e in edges]
    index = [(e[:, 1].long(), e[:, 2].long(), e[:, 3].long()) for e in per_layer]
    residual = nodes["residual"][row]
    kept, reached = fg.trace_routes(index, residual > threshold, target)
    g = nx.MultiDiGraph()
    for layer, pos in reached.nonzero().tolist():
        attrs = {"layer": layer, "position": pos, "token": str_tokens[pos]}
        if layer >= 1:
            attrs.update({p: float(nodes[p][row, layer - 1, pos]) for p in nodes})
        g.add_node((layer, pos), **attrs)
    nan = float("nan")
    for layer in range(n_layers):
        for _, h, i, j, share, alpha, rel, cos in per_layer[layer][kept[layer]].tolist():
            g.add_edge(
                (layer, int(j)),
                (layer + 1, int(i)),
                key=int(h),
                layer=layer,
                head=int(h),
                kind="attention",
                share=share,
                attention=alpha,
                relative_norm=rel,
                cosine=cos,
            )
        for i in (reached[layer + 1] & reached[layer] & (residual[layer] > threshold)).nonzero():
            i = int(i)
            g.add_edge(
                (layer, i),
                (layer + 1, i),
                key="residual",
                layer=layer,
                head=-1,
                kind="residual",
                share=float(residual[layer, i]),
                attention=nan,
                relative_norm=nan,
                cosine=nan,
            )
    return RouteGraph(g, target, threshold, str_tokens, n_layers, model_name)


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be a number, got {threshold!r}.")
    if not 0.0 <= float(threshold) < 1.0:
        raise InputError(
            f"threshold must lie in [0, 1) (a share of the residual stream), got {threshold}."
        )
    return float(threshold)


@keyword_only("target", "threshold")
def routes(
    model: Any,
    text: Any,
    *,
    target: int = -1,
    threshold: float = 0.02,
    prepend_bos: bool = True,
    query_chunk: int | None = None,
) -> RouteGraph:
    """The route graph of one text, traced back from position ``target``.

    Args:
        model: A ``TransformerBridge``.
        text: One string (or token ids ``[1, pos]``).
        target: The position whose final stream to explain (negative counts from the end).
        threshold: Keep edges whose share exceeds this (a fraction of the receiving stream).
        prepend_bos: Prepend BOS to text.
        query_chunk: Query rows per streamed block (``None``: automatic).

    Returns:
        A :class:`RouteGraph`.
    """
    require_verified(model)
    threshold = check_threshold(threshold)
    batch = prepare_inputs(model, text, prepend_bos=prepend_bos)
    if batch.tokens.shape[0] != 1:
        raise InputError(
            f"routes explains one text; got {batch.tokens.shape[0]}. Loop over the texts, or "
            "use ioi_route_statistics for task items."
        )
    n = int(batch.lengths[0])
    if isinstance(target, bool) or not isinstance(target, int) or not -n <= target < n:
        raise InputError(f"target must be a position in {-n}..{n - 1}, got {target!r}.")
    collector = RouteCollector(model.cfg.n_layers, threshold)
    stream_shares(
        model, batch.tokens, collector, query_chunk=query_chunk, batch_size=None, progress=False
    )
    edges, nodes = collector.tables()
    return build_route_graph(
        edges,
        nodes,
        0,
        target % n,
        threshold,
        batch.str_tokens(model)[0],
        str(getattr(model.cfg, "model_name", "")),
    )
