r"""Contribution weights (P1): how much each token really moves a head's or a layer's output.

For query ``i``, key ``j`` and head ``h`` of one layer (SPEC §2; Cunningham & Muca Cirone,
"Contribution Weights: A Geometrical Analysis of Self-Attention Transformers", ICML 2026)::

    intra  c[i,j]^h = < alpha[i,j]^h pv_j^h , o_i^h > / ||o_i^h||^2
                    = alpha[i,j]^h * ( ||pv_j^h|| / ||o_i^h|| ) * cos(pv_j^h, o_i^h)
    inter  C[i,j]^h = < alpha[i,j]^h pv_j^h , o_i > / ||o_i||^2

with ``pv_j^h = v_j W_O^h`` the projected value, ``o_i^h`` the head output and ``o_i = sum_h o_i^h``
the layer output (``b_O`` excluded). ``sum_j c[i,j]^h = 1`` and ``sum_h sum_j C[i,j]^h = 1``;
weights can be negative (destructive interference) and exceed 1. Baselines (SPEC §2):
``attention`` = alpha, ``value_norm`` = alpha ||pv_j|| (Kobayashi et al. 2020),
``value_norm_output`` = alpha ||pv_j|| / ||o_i^h||.

Conventions: keys after the query (``j > i``) are 0 in every field; query rows at padding are
NaN (at ``j <= i``); a query whose output norm is numerically zero (below ``1e-6`` of the largest
projected-value norm among its keys) has undefined weights — NaN — and is counted in
``n_nan_rows`` with one warning per call. A key whose
projected value is zero has cosine 0. Weights are those the model runs (raw bridge); a bridge in
compatibility mode (folded/centred weights) gives results for those weights.

Three entry points:

- :func:`contribution_weights` — a :class:`ContributionResult` ``[batch, layer, head, query,
  key]`` for a few texts;
- :func:`contribution_weights_from_cache` — from an ``ActivationCache`` you already have;
- :func:`stream_contributions` — the streaming form every corpus analysis uses: a callback gets
  one :class:`LayerContributions` (one layer, one block of query rows) at a time, inside the
  forward pass, so memory stays flat in depth and corpus size.

Example::

    import cw_lens
    model = cw_lens.load_model()
    cw = cw_lens.contribution_weights(model, "The capital of France is Paris.", layers=[5])
    cw.top(k=5)                      # the (layer, head, key) pairs that move the last token most
    cw.plot(layer=5, head=0)         # attention next to contribution (P1, Fig. 1)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from cw_lens import geometry as geo
from cw_lens.capture import (
    LayerActivations,
    LayerWeights,
    check_model,
    hook_name,
    resolve_heads,
    resolve_layers,
    run_layers,
)
from cw_lens.errors import InputError
from cw_lens.inputs import TokenBatch, iter_batches, prepare_inputs

Kind = Literal["intra", "inter"]
KINDS = ("intra", "inter")
# Metric names of the faithfulness protocol (SPEC §5), in P1's order.
METRICS = ("attention", "value_norm", "value_norm_output", "contribution")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise InputError(f"kind must be 'intra' or 'inter', got {kind!r}.")


class Workspace:
    """Reusable float32 buffers for the streamed ``[batch, head, query, key]`` tensors.

    Fresh multi-megabyte tensors cost page faults on every allocation; reusing one buffer per
    role makes the streamed arithmetic several times cheaper. With ``reuse=False`` every request
    gets a fresh tensor.
    """

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: Sequence[int], device: torch.device) -> Tensor:
        numel = math.prod(shape)
        if not self.reuse:
            return torch.empty(tuple(shape), device=device)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(numel, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(tuple(shape))


class LayerContributions:
    """Contribution geometry of one layer for one block of query rows (the streaming unit).

    Tensors are ``[batch, head, query, key]`` over the selected heads, the query rows
    ``queries`` and the keys ``0 .. queries.stop - 1`` (later keys are never attended by these
    rows, so they are left out: every field would be 0 there). Quantities are computed lazily
    in head space and cached for the life of the block.

    With a reusing :class:`Workspace` (the default of :func:`stream_contributions`) the
    returned tensors live in buffers that the next block overwrites: reduce them inside the
    callback, or ``.clone()`` what you keep.

    Conventions: entries with ``j > i`` are 0; rows of padded queries and of queries with a
    numerically zero output norm are NaN at ``j <= i``.
    """

    def __init__(
        self,
        acts: LayerActivations,
        heads: list[int] | None = None,
        queries: slice | None = None,
        shared: dict[str, Any] | None = None,
        workspace: Workspace | None = None,
    ) -> None:
        self.acts = acts
        self.layer = acts.layer
        self.heads = sorted(set(heads)) if heads is not None else list(range(acts.n_heads))
        self._all_heads = len(self.heads) == acts.n_heads
        n_pos = acts.pattern.shape[-1]
        self.queries = queries if queries is not None else slice(0, n_pos)
        self.keys = slice(0, self.queries.stop)
        self._shared = {} if shared is None else shared
        self._ws = workspace if workspace is not None else Workspace(reuse=False)
        self._cache: dict[Any, Any] = {}

    # ------------------------------------------------------------------ raw pieces
    @property
    def batch(self) -> TokenBatch:
        return self.acts.batch

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, head, query, key)`` of every pairwise field of this block."""
        return (
            self.acts.pattern.shape[0],
            len(self.heads),
            self.queries.stop - self.queries.start,
            self.keys.stop,
        )

    @property
    def query_positions(self) -> Int[Tensor, " query"]:
        return torch.arange(self.queries.start, self.queries.stop, device=self.acts.mask.device)

    def _memo(self, key: Any, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def _layer_memo(self, key: str, fn: Callable[[], Tensor]) -> Tensor:
        if key not in self._shared:
            self._shared[key] = fn()
        return self._shared[key]

    @cached_property
    def _head_index(self) -> Tensor:
        return torch.tensor(self.heads, device=self.acts.pattern.device)

    def _sel(self, t: Tensor, axis: int = 1) -> Tensor:
        return t if self._all_heads else t.index_select(axis, self._head_index)

    @cached_property
    def attention(self) -> Float[Tensor, "batch head query key"]:
        """``alpha[i,j]^h`` (a view of ``hook_pattern``; padded rows are not NaN here)."""
        return self._sel(self.acts.pattern[:, :, self.queries, self.keys])

    @cached_property
    def query_mask(self) -> Bool[Tensor, "batch query"]:
        """True at real (non-padding) query positions."""
        return self.acts.mask[:, self.queries]

    @cached_property
    def _padded(self) -> bool:
        return not bool(self.query_mask.all())

    @cached_property
    def _full_key_norms(self) -> Float[Tensor, "batch head key"]:
        return self._layer_memo(
            "pv_norm", lambda: geo.projected_value_norms(self.acts.values, self.acts.weights.gram)
        )

    @cached_property
    def projected_value_norm(self) -> Float[Tensor, "batch head key"]:
        """``||pv_j^h||`` for the keys of this block."""
        return self._sel(self._full_key_norms[..., self.keys])

    @cached_property
    def _inv_key_norm(self) -> Tensor:
        kn = self.projected_value_norm
        return torch.where(kn > 0, kn.reciprocal(), torch.zeros((), device=kn.device))

    @cached_property
    def _key_scale(self) -> Float[Tensor, "batch head query"]:
        """``max_{j<=i} ||pv_j^h||`` over all heads (for zero-norm detection)."""
        full = self._layer_memo("pv_scale", lambda: geo.key_norm_scale(self._full_key_norms))
        return full[..., self.queries]

    @cached_property
    def _z(self) -> Tensor:
        return self.acts.z[:, self.queries]

    @cached_property
    def head_output_norm(self) -> Float[Tensor, "batch head query"]:
        """``||o_i^h||``."""
        return self._sel(geo.head_output_norms(self._z, self.acts.weights.gram))

    @cached_property
    def layer_output_norm(self) -> Float[Tensor, "batch query"]:
        """``||o_i||`` (``b_O`` excluded)."""
        return self.acts.layer_output[:, self.queries].norm(dim=-1)

    def output_norm(self, kind: Kind = "intra") -> Float[Tensor, "batch head query"]:
        """The norm a weight is relative to: ``||o_i^h||`` (intra) or ``||o_i||`` (inter)."""
        _check_kind(kind)
        if kind == "intra":
            return self.head_output_norm
        return self.layer_output_norm[:, None, :].expand_as(self.head_output_norm)

    def zero_rows(self, kind: Kind = "intra") -> Bool[Tensor, "batch head query"]:
        """Real queries whose output norm is numerically zero (their weights are NaN)."""
        _check_kind(kind)

        def compute() -> Tensor:
            if kind == "intra":
                zero = geo.zero_output_rows(self.head_output_norm, self._sel(self._key_scale))
            else:
                z = geo.zero_output_rows(self.layer_output_norm, self._key_scale.sum(1))
                zero = z[:, None, :].expand(-1, len(self.heads), -1)
            return zero & self.query_mask[:, None, :]

        return self._memo(("zero", kind), compute)

    def n_zero_rows(self, kind: Kind = "intra") -> int:
        return int(self.zero_rows(kind).sum())

    def _inv_output_norm(self, kind: Kind) -> Float[Tensor, "batch head query"]:
        """``1 / ||o_i||``, NaN at padded and zero-norm rows (so they come out NaN)."""

        def compute() -> Tensor:
            bad = self.zero_rows(kind) | ~self.query_mask[:, None, :]
            return self.output_norm(kind).reciprocal().masked_fill(bad, math.nan)

        return self._memo(("inv_norm", kind), compute)

    def _row_nan(self, t: Tensor) -> Tensor:
        """Set padded query rows of ``t`` (in place) to NaN at ``j <= i``."""
        if self._padded:
            t.masked_fill_(~self.query_mask[:, None, :, None], math.nan)
            t.tril_(diagonal=self.queries.start)
        return t

    def _grouped(self, query_side: Tensor, out: Tensor) -> Tensor:
        """``<query_side[b,i,h], v_j^{g(h)}>`` for the selected heads and this block's keys."""
        values = self.acts.values[:, self.keys]
        if self._all_heads:
            return geo.grouped_scores(query_side, values, out=out)
        group = self.acts.n_heads // values.shape[2]
        kv = torch.tensor([h // group for h in self.heads], device=values.device)
        q = query_side.index_select(2, self._head_index)
        return torch.einsum("bqhd,bkhd->bhqk", q, values.index_select(2, kv))

    def scaled_dots(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """``<pv_j^h, o_i> / ||o_i||`` = ``||pv_j|| cos(pv_j, o_i)`` with ``o`` per ``kind``.

        The ``1/||o_i||`` scale is folded into the (small) query side before the product, so
        undefined rows come out NaN without a pass over the ``query x key`` tensor.
        """
        _check_kind(kind)

        def compute() -> Tensor:
            w = self.acts.weights
            inv = self._inv_output_norm(kind)  # [batch, head(sel), query]
            if kind == "intra":
                side = geo.apply_gram(self._z, w.gram)
                if self._all_heads:
                    side = side * inv.transpose(1, 2)[..., None]
                else:
                    full = torch.ones(side.shape[:3], device=side.device)
                    full[:, :, self._head_index] = inv.transpose(1, 2)
                    side = side * full[..., None]
            else:
                out = self.acts.layer_output[:, self.queries] * inv[:, 0, :, None]
                side = geo.project_into_heads(out, w.W_O)
            buf = self._ws.get(f"dots_{kind}", self.shape, side.device)
            return self._grouped(side, buf)

        return self._memo(("scaled_dots", kind), compute)

    def dots(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """``<pv_j^h, o_i^h>`` (intra) or ``<pv_j^h, o_i>`` (inter); a fresh tensor."""
        return self.scaled_dots(kind) * self.output_norm(kind)[..., None]

    # ------------------------------------------------------------------ fields
    def weights(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """Contribution weights ``c`` (intra) or ``C`` (inter)."""

        def compute() -> Tensor:
            buf = self._ws.get(f"weights_{kind}", self.shape, self.acts.pattern.device)
            torch.mul(self.attention, self.scaled_dots(kind), out=buf)
            buf.mul_(self._inv_output_norm(kind)[..., None])
            return buf.tril_(diagonal=self.queries.start)

        return self._memo(("weights", kind), compute)

    def cosine(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """``cos(pv_j^h, o_i^h)`` (intra) or ``cos(pv_j^h, o_i)`` (inter); 0 for a zero ``pv_j``."""

        def compute() -> Tensor:
            buf = self._ws.get(f"cosine_{kind}", self.shape, self.acts.pattern.device)
            torch.mul(self.scaled_dots(kind), self._inv_key_norm[:, :, None, :], out=buf)
            return buf.tril_(diagonal=self.queries.start)

        return self._memo(("cosine", kind), compute)

    def relative_norm(self, kind: Kind = "intra") -> Float[Tensor, "batch head query key"]:
        """``||pv_j^h|| / ||o_i^h||`` (intra) or ``||pv_j^h|| / ||o_i||`` (inter)."""

        def compute() -> Tensor:
            buf = self._ws.get(f"relative_norm_{kind}", self.shape, self.acts.pattern.device)
            torch.mul(
                self._inv_output_norm(kind)[..., None],
                self.projected_value_norm[:, :, None, :],
                out=buf,
            )
            return buf.tril_(diagonal=self.queries.start)

        return self._memo(("relative_norm", kind), compute)

    def value_norm(self) -> Float[Tensor, "batch head query key"]:
        """Baseline ``alpha ||pv_j||``."""

        def compute() -> Tensor:
            buf = self._ws.get("value_norm", self.shape, self.acts.pattern.device)
            torch.mul(self.attention, self.projected_value_norm[:, :, None, :], out=buf)
            return self._row_nan(buf)

        return self._memo("value_norm", compute)

    def value_norm_output(self) -> Float[Tensor, "batch head query key"]:
        """Baseline ``alpha ||pv_j|| / ||o_i^h||`` (the per-head output norm)."""

        def compute() -> Tensor:
            buf = self._ws.get("value_norm_output", self.shape, self.acts.pattern.device)
            torch.mul(self.attention, self.projected_value_norm[:, :, None, :], out=buf)
            buf.mul_(self._inv_output_norm("intra")[..., None])
            return buf.tril_(diagonal=self.queries.start)

        return self._memo("value_norm_output", compute)

    def masked_attention(self) -> Float[Tensor, "batch head query key"]:
        """``alpha`` with padded query rows NaN (a copy only when the batch is padded)."""
        if not self._padded:
            return self.attention
        buf = self._ws.get("attention", self.shape, self.acts.pattern.device)
        buf.copy_(self.attention)
        return self._row_nan(buf)

    def metric(self, name: str, kind: Kind = "inter") -> Float[Tensor, "batch head query key"]:
        """A score by name (``attention``, ``value_norm``, ``value_norm_output``,
        ``contribution``); ``kind`` applies to ``contribution``."""
        if name == "attention":
            return self.masked_attention()
        if name == "value_norm":
            return self.value_norm()
        if name == "value_norm_output":
            return self.value_norm_output()
        if name == "contribution":
            return self.weights(kind)
        raise InputError(f"Unknown metric {name!r}; choose one of {', '.join(METRICS)}.")


# ---------------------------------------------------------------------- streaming


def memory_budget(
    device: torch.device | str = "cpu", share: float = 0.1, cap: float = 1.5e9
) -> float:
    """Bytes the streamed blocks may use: ``share`` of the free memory, at most ``cap``.

    Free memory is ``MemAvailable`` (Linux) on the CPU and the free CUDA memory on a GPU.
    """
    device = torch.device(device)
    free = None
    if device.type == "cuda" and torch.cuda.is_available():
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
        except OSError:
            free = None
    return cap if free is None else max(64e6, min(cap, share * free))


def auto_query_chunk(
    n_batch: int,
    n_heads: int,
    n_keys: int,
    budget_bytes: float | None = None,
    temporaries: int = 10,
    min_blocks: int = 4,
) -> int:
    """Query rows per block.

    At most what lets ``temporaries`` float32 ``[batch, head, rows, keys]`` tensors fit in
    ``budget_bytes`` (default :func:`memory_budget`: a tenth of the free memory, at most
    1.5 GB), and at most ``n_keys / min_blocks``: block ``b`` only needs the keys up to its last
    row, so ``min_blocks`` blocks skip about ``(1 - 1/min_blocks) / 2`` of the ``query x key``
    work that causality makes zero. At least 32 rows.
    """
    budget_bytes = memory_budget() if budget_bytes is None else budget_bytes
    per_row = n_batch * n_heads * n_keys * 4 * temporaries
    by_memory = int(budget_bytes // max(per_row, 1))
    by_causality = math.ceil(n_keys / min_blocks)
    return max(32, min(by_memory, by_causality))


@dataclass
class StreamStats:
    """What a streaming run saw: documents, tokens, and NaN rows per kind."""

    n_documents: int = 0
    n_tokens: int = 0
    n_nan_rows: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})

    def merge(self, other: StreamStats) -> None:
        self.n_documents += other.n_documents
        self.n_tokens += other.n_tokens
        for kind, n in other.n_nan_rows.items():
            self.n_nan_rows[kind] = self.n_nan_rows.get(kind, 0) + n


def stream_contributions(
    model: Any,
    inputs: Any,
    consumer: Callable[[LayerContributions], None],
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    query_chunk: int | None = None,
    batch_size: int | None = 8,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    fwd_hooks: Sequence[tuple[str, Callable]] | Callable[[TokenBatch], Sequence] = (),
    on_logits: Callable[[TokenBatch, Tensor], None] | None = None,
    progress: bool | str = False,
    count_nan: Sequence[str] = (),
    reuse_buffers: bool = True,
    shard: tuple[int, int] | None = None,
) -> StreamStats:
    """Stream one layer (and one block of query rows) at a time to ``consumer``.

    The consumer is called inside the forward pass with a :class:`LayerContributions`; it
    should fold what it needs into a small accumulator and keep no references to full tensors.

    Args:
        model: A ``TransformerBridge``.
        inputs: Text, a list of texts, a corpus, or token ids ``[batch, pos]``.
        consumer: Called once per (document batch, layer, query block).
        layers: Layers to analyse (``None`` = all).
        heads: Query heads to analyse (``None`` = all).
        query_chunk: Query rows per block; ``None`` picks one from the free memory
            (:func:`auto_query_chunk`).
        batch_size: Documents per forward pass (``None`` = all at once).
        prepend_bos: Prepend BOS to text inputs.
        attention_mask: Mask for token-tensor inputs with padding.
        fwd_hooks: Interventions active during the passes: hook pairs, or a function of the
            document batch that returns them (for interventions that need the batch's mask).
        on_logits: If given, the passes run to the end and this gets ``(batch, logits)``.
        progress: Show a tqdm bar over document batches (a string sets its label).
        count_nan: Kinds (``"intra"``/``"inter"``) whose zero-norm rows to count and warn about.
        reuse_buffers: Reuse one buffer per field across blocks (fast; tensors handed to the
            consumer are then valid only during the call). ``False`` allocates fresh tensors.
        shard: ``(rank, world)``: process only document batches ``rank, rank + world, ...`` of
            the batch plan (the plan itself is the same on every rank).

    Returns:
        A :class:`StreamStats`.
    """
    check_model(model)
    if not callable(consumer):
        raise InputError(
            f"consumer must be a function of one LayerContributions, got {type(consumer).__name__}."
        )
    if query_chunk is not None and (
        isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1
    ):
        raise InputError(f"query_chunk must be a positive integer or None, got {query_chunk!r}.")
    layer_list = resolve_layers(model, layers)
    head_list = None if heads is None else resolve_heads(model, heads)
    prepared = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    stats = StreamStats()
    weights: dict[int, LayerWeights] = {}
    workspace = Workspace(reuse=reuse_buffers)
    batches = list(iter_batches(prepared, batch_size))
    if shard is not None:
        rank, world = shard
        batches = batches[rank::world]
    label = progress if isinstance(progress, str) else "contributions"
    bar = tqdm(batches, desc=label, disable=not progress, leave=False)
    for batch in bar:
        n_keys = batch.tokens.shape[1]
        chunk = query_chunk or auto_query_chunk(
            batch.tokens.shape[0],
            len(head_list or range(model.cfg.n_heads)),
            n_keys,
            memory_budget(model.cfg.device or "cpu"),
        )

        def on_layer(acts: LayerActivations, n_keys: int = n_keys, chunk: int = chunk) -> None:
            shared: dict[str, Any] = {}
            for start in range(0, n_keys, chunk):
                rows = slice(start, min(n_keys, start + chunk))
                lc = LayerContributions(acts, head_list, rows, shared, workspace)
                for kind in count_nan:
                    stats.n_nan_rows[kind] += lc.n_zero_rows(kind)
                consumer(lc)

        logits = run_layers(
            model,
            batch,
            on_layer,
            layers=layer_list,
            fwd_hooks=fwd_hooks(batch) if callable(fwd_hooks) else fwd_hooks,
            need_logits=on_logits is not None,
            weights=weights,
        )
        if on_logits is not None:
            on_logits(batch, logits)
        stats.n_documents += batch.tokens.shape[0]
        stats.n_tokens += int(batch.mask.sum())
    for kind in count_nan:
        if stats.n_nan_rows[kind]:
            warnings.warn(
                f"{stats.n_nan_rows[kind]} (layer, head, query) rows have a numerically zero "
                f"{kind}-head output norm; their contribution weights are NaN (undefined).",
                RuntimeWarning,
                stacklevel=2,
            )
    return stats


# ---------------------------------------------------------------------- full results


@dataclass
class ContributionResult:
    """Contribution weights and their decomposition, ``[batch, layer, head, query, key]``.

    Stored: ``attention``, ``cosine``, ``projected_value_norm`` ``[batch, layer, head, key]``,
    ``output_norm`` and ``head_output_norm`` ``[batch, layer, head, query]``. Derived on first
    access (and cached): ``weights = attention * relative_norm * cosine``, ``relative_norm``,
    ``value_norm``, ``value_norm_output``. Positions index ``tokens``; ``mask`` is False at
    padding (whose rows are NaN). ``layers``/``heads`` name the layer and head axes.
    """

    attention: Float[Tensor, "batch layer head query key"]
    cosine: Float[Tensor, "batch layer head query key"]
    projected_value_norm: Float[Tensor, "batch layer head key"]
    output_norm: Float[Tensor, "batch layer head query"]
    head_output_norm: Float[Tensor, "batch layer head query"]
    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    layers: list[int]
    heads: list[int]
    kind: str
    prepend_bos: bool
    bos_token: str | None
    n_nan_rows: int = 0
    model_name: str = ""

    # ----------------------------------------------------------------- derived fields
    def _per_pair(self, key_norm: Tensor, query_norm: Tensor) -> Tensor:
        """``key_norm[j] / query_norm[i]`` with the result conventions: 0 for ``j > i``; NaN at
        ``j <= i`` for padded query rows and rows whose norm is NaN (zero-norm rows)."""
        n = self.tokens.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=key_norm.device).tril()
        padded = ~self.mask[:, None, None, :].to(key_norm.device)
        query_norm = query_norm.masked_fill(padded, math.nan)
        ratio = key_norm.nan_to_num(0.0)[..., None, :] / query_norm[..., :, None]
        return torch.where(causal, ratio, torch.zeros((), device=ratio.device))

    @cached_property
    def relative_norm(self) -> Float[Tensor, "batch layer head query key"]:
        """``||pv_j|| / ||o_i||`` (the norm ``kind`` refers to)."""
        return self._per_pair(self.projected_value_norm, self.output_norm)

    @cached_property
    def weights(self) -> Float[Tensor, "batch layer head query key"]:
        """Contribution weights: ``attention * relative_norm * cosine``."""
        return self.attention * self.relative_norm * self.cosine

    @cached_property
    def value_norm(self) -> Float[Tensor, "batch layer head query key"]:
        """Baseline ``alpha ||pv_j||``."""
        return self.attention * self.projected_value_norm.nan_to_num(0.0)[..., None, :]

    @cached_property
    def value_norm_output(self) -> Float[Tensor, "batch layer head query key"]:
        """Baseline ``alpha ||pv_j|| / ||o_i^h||`` (NaN rows where ``||o_i^h||`` is zero)."""
        return self.attention * self._per_pair(self.projected_value_norm, self.head_output_norm)

    # ----------------------------------------------------------------- helpers
    FIELDS = ("attention", "relative_norm", "cosine", "weights", "value_norm", "value_norm_output")

    def _layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise InputError(f"Layer {layer} is not in this result (layers {self.layers}).")
        return self.layers.index(layer)

    def _head_index(self, head: int) -> int:
        if head not in self.heads:
            raise InputError(f"Head {head} is not in this result (heads {self.heads}).")
        return self.heads.index(head)

    def _batch_index(self, batch: int) -> int:
        n = self.tokens.shape[0]
        if not isinstance(batch, int) or not 0 <= batch < n:
            raise InputError(f"batch must be a row index in 0..{n - 1}, got {batch!r}.")
        return batch

    def last_position(self, batch: int = 0) -> int:
        return int(self.mask[batch].sum()) - 1

    def to_dataframe(
        self,
        *,
        batch: int | None = None,
        layer: int | None = None,
        head: int | None = None,
        query: int | None = None,
    ) -> pd.DataFrame:
        """Long format: one row per (batch, layer, head, query, key) with ``key <= query``.

        Columns: batch, layer, head, query, key, query_token, key_token, and every field.
        Filter with the keyword arguments to keep the frame small.
        """
        b_idx = range(self.tokens.shape[0]) if batch is None else [self._batch_index(batch)]
        l_idx = range(len(self.layers)) if layer is None else [self._layer_index(layer)]
        h_idx = range(len(self.heads)) if head is None else [self._head_index(head)]
        frames = []
        fields = {name: getattr(self, name) for name in self.FIELDS}
        for b in b_idx:
            n = int(self.mask[b].sum())
            q_idx = np.arange(n) if query is None else np.array([query])
            qq, kk = np.meshgrid(q_idx, np.arange(n), indexing="ij")
            keep = kk <= qq
            qq, kk = qq[keep], kk[keep]
            for li in l_idx:
                for hi in h_idx:
                    data = {
                        "batch": b,
                        "layer": self.layers[li],
                        "head": self.heads[hi],
                        "query": qq,
                        "key": kk,
                        "query_token": np.array(self.str_tokens[b], dtype=object)[qq],
                        "key_token": np.array(self.str_tokens[b], dtype=object)[kk],
                    }
                    for name, t in fields.items():
                        data[name] = t[b, li, hi].detach().cpu().numpy()[qq, kk]
                    frames.append(pd.DataFrame(data))
        return pd.concat(frames, ignore_index=True)

    def top(
        self,
        *,
        query: int | None = None,
        k: int = 10,
        batch: int = 0,
        layer: int | None = None,
        head: int | None = None,
        by: str = "weights",
        absolute: bool = False,
        sum_heads: bool = False,
    ) -> pd.DataFrame:
        """The ``k`` largest entries for one query (default: the last real token).

        Args:
            by: Field to rank by (any of ``FIELDS``).
            absolute: Rank by magnitude (negative weights count too).
            sum_heads: Sum over heads first — one score per (layer, key); with ``kind="inter"``
                this is the token's share of the layer output.
        """
        if by not in self.FIELDS:
            raise InputError(f"by must be one of {self.FIELDS}, got {by!r}.")
        self._batch_index(batch)
        if sum_heads and self.kind == "intra" and by == "weights":
            warnings.warn(
                "sum_heads=True adds intra-head weights, each relative to its own head's output; "
                "the sum is not a share of anything. Use kind='inter' for a token's share of "
                "the layer output.",
                UserWarning,
                stacklevel=2,
            )
        q = self.last_position(batch) if query is None else query
        n = int(self.mask[batch].sum())
        if not 0 <= q < n:
            raise InputError(f"Query {q} is outside the {n} real positions of batch row {batch}.")
        scores = getattr(self, by)[batch, :, :, q, : q + 1]  # [layer, head, key]
        layers = list(range(len(self.layers))) if layer is None else [self._layer_index(layer)]
        heads = list(range(len(self.heads))) if head is None else [self._head_index(head)]
        scores = scores[layers][:, heads]
        rows = []
        if sum_heads:
            summed = scores.nansum(1)
            for li, lay in enumerate(layers):
                for key in range(q + 1):
                    rows.append((self.layers[lay], None, key, float(summed[li, key])))
        else:
            for li, lay in enumerate(layers):
                for hi, hd in enumerate(heads):
                    for key in range(q + 1):
                        rows.append(
                            (self.layers[lay], self.heads[hd], key, float(scores[li, hi, key]))
                        )
        df = pd.DataFrame(rows, columns=["layer", "head", "key", by])
        df["key_token"] = [self.str_tokens[batch][key] for key in df["key"]]
        df["query"] = q
        order = df[by].abs() if absolute else df[by]
        df = df.loc[order.sort_values(ascending=False, na_position="last").index].head(k)
        if sum_heads:
            df = df.drop(columns="head")
        return df.reset_index(drop=True)

    def plot(self, layer: int | None = None, head: int = 0, *, batch: int = 0, **kwargs: Any):
        """Attention next to contribution weights for one head (P1, Fig. 1); a Figure."""
        from cw_lens.plots import plot_attention_vs_contribution

        layer = self.layers[0] if layer is None else layer
        self._layer_index(layer)
        self._head_index(head)
        self._batch_index(batch)
        return plot_attention_vs_contribution(self, layer=layer, head=head, batch=batch, **kwargs)

    def show(self, **kwargs: Any) -> Any:
        """The interactive token view in Jupyter (tokens coloured by contribution)."""
        from cw_lens.viz import show_contributions

        return show_contributions(self, **kwargs)

    def to_html(self, path: Any = None, **kwargs: Any) -> str:
        """A self-contained HTML view of this result; written to ``path`` when given."""
        from cw_lens.viz import contributions_html

        html = contributions_html(self, **kwargs)
        if path is not None:
            from pathlib import Path

            Path(path).write_text(html, encoding="utf-8")
        return html


class _ResultFiller:
    """Consumer that writes each streamed block into preallocated result tensors."""

    def __init__(
        self,
        n_docs: int,
        n_pos: int,
        layers: list[int],
        heads: int,
        kind: Kind,
        device: torch.device,
    ) -> None:
        shape = (n_docs, len(layers), heads, n_pos, n_pos)
        self.kind = kind
        self.layer_pos = {layer: i for i, layer in enumerate(layers)}
        # written block by block (keys past each block's last row are zeroed then), so the
        # big tensors are touched once instead of being zero-filled first
        self.attention = torch.empty(shape, device=device)
        self.cosine = torch.empty(shape, device=device)
        self.pv_norm = torch.full((*shape[:3], n_pos), math.nan, device=device)
        self.out_norm = torch.full(shape[:4], math.nan, device=device)
        self.head_norm = torch.full(shape[:4], math.nan, device=device)

    def __call__(self, lc: LayerContributions) -> None:
        li = self.layer_pos[lc.layer]
        q, k = lc.queries, lc.keys
        docs = lc.batch.documents
        if docs == list(range(self.attention.shape[0])):
            docs = slice(None)  # the common case: plain slicing, no gather
        else:
            docs = torch.tensor(docs, device=self.attention.device)
        self.attention[docs, li, :, q, k] = lc.masked_attention()
        self.cosine[docs, li, :, q, k] = lc.cosine(self.kind)
        self.attention[docs, li, :, q, k.stop :] = 0.0
        self.cosine[docs, li, :, q, k.stop :] = 0.0
        self.pv_norm[docs, li, :, k] = lc.projected_value_norm
        out = lc.output_norm(self.kind).masked_fill(lc.zero_rows(self.kind), math.nan)
        self.out_norm[docs, li, :, q] = out
        self.head_norm[docs, li, :, q] = lc.head_output_norm.masked_fill(
            lc.zero_rows("intra"), math.nan
        )

    def mark_padding(self, lengths: list[int]) -> None:
        """NaN for query rows at padding (also beyond each sub-batch's trimmed width)."""
        for b, n in enumerate(lengths):
            for stored in (self.attention, self.cosine):
                rows = stored[b, :, :, n:, :]  # queries n.. : NaN at keys j <= i, 0 after
                rows.fill_(math.nan)
                rows.tril_(diagonal=n)
            self.pv_norm[b, :, :, n:] = math.nan


class _Both:
    """The result filler (its layers) and a user's ``on_block`` (its own layers, or all)."""

    def __init__(
        self, filler: _ResultFiller, on_block: Callable, restrict: bool, layers: list[int]
    ) -> None:
        self.filler, self.on_block, self.restrict, self.layers = filler, on_block, restrict, layers

    def __call__(self, lc: LayerContributions) -> None:
        if lc.layer in self.filler.layer_pos:
            self.filler(lc)
        if not self.restrict or lc.layer in self.layers:
            self.on_block(lc)


def contribution_weights(
    model: Any,
    inputs: Any,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    kind: Kind = "intra",
    query_chunk: int | None = None,
    prepend_bos: bool = True,
    attention_mask: Tensor | None = None,
    batch_size: int | None = 8,
    fwd_hooks: Sequence[tuple[str, Callable]] = (),
    on_logits: Callable[[TokenBatch, Tensor], None] | None = None,
    on_block: Callable[[LayerContributions], None] | None = None,
    block_layers: int | Sequence[int] | None = None,
) -> ContributionResult:
    """Contribution weights of every (layer, head, query, key) for a few texts.

    Args:
        model: A ``TransformerBridge`` (``cw_lens.load_model()``).
        inputs: A string, a list of strings (right-padded batch; padding is excluded and marked
            NaN), or token ids ``[batch, pos]`` (with ``attention_mask`` when padded).
        layers: Layers (``None`` = all; negative indices allowed).
        heads: Query heads (``None`` = all).
        kind: ``"intra"`` projects on the head output ``o_i^h``; ``"inter"`` on the layer
            output ``o_i``.
        query_chunk: Query rows per block (``None`` = automatic from a memory budget).
        prepend_bos: Prepend BOS to text (position 0 is then BOS, the usual sink).
        attention_mask: For token tensors with padding.
        batch_size: Texts per forward pass.
        fwd_hooks: Interventions active during the pass (e.g. ``patch_sink(...).hooks``): the
            weights are then those of the intervened model.
        on_logits: If given, the pass runs to the end and this gets ``(batch, logits)`` of
            the same pass (one forward pass for weights and predictions).
        on_block: If given, also called with every streamed :class:`LayerContributions`
            (inside the pass; see :func:`stream_contributions` for the lifetime rules).
        block_layers: The layers whose blocks go to ``on_block`` (default: ``layers``); those
            not in ``layers`` are streamed for ``on_block`` only, not stored in the result.

    Returns:
        A :class:`ContributionResult`. It holds ``2 x batch x layers x heads x pos^2`` floats;
        for corpora use :func:`stream_contributions` or the corpus analyses.
    """
    _check_kind(kind)
    check_model(model)
    batch = prepare_inputs(model, inputs, prepend_bos=prepend_bos, attention_mask=attention_mask)
    layer_list = resolve_layers(model, layers)
    head_list = resolve_heads(model, heads)
    extra = (
        [] if block_layers is None or not len(block_layers) else resolve_layers(model, block_layers)
    )
    if extra and on_block is None:
        raise InputError("block_layers needs on_block (the function that gets those blocks).")
    device = torch.device(model.cfg.device or "cpu")
    filler = _ResultFiller(
        batch.tokens.shape[0], batch.tokens.shape[1], layer_list, len(head_list), kind, device
    )
    stats = stream_contributions(
        model,
        batch.tokens,
        filler if on_block is None else _Both(filler, on_block, block_layers is not None, extra),
        layers=sorted(set(layer_list) | set(extra)),
        heads=None if len(head_list) == model.cfg.n_heads else head_list,
        query_chunk=query_chunk,
        batch_size=batch_size,
        attention_mask=batch.mask.long(),  # always: a text may contain the pad token itself
        count_nan=(kind,),
        fwd_hooks=fwd_hooks,
        on_logits=on_logits,
    )
    filler.mark_padding(batch.lengths.tolist())
    return ContributionResult(
        attention=filler.attention,
        cosine=filler.cosine,
        projected_value_norm=filler.pv_norm,
        output_norm=filler.out_norm,
        head_output_norm=filler.head_norm,
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model),
        layers=layer_list,
        heads=head_list,
        kind=kind,
        prepend_bos=batch.prepend_bos,
        bos_token=batch.bos_token,
        n_nan_rows=stats.n_nan_rows[kind],
        model_name=str(getattr(model.cfg, "model_name", "")),
    )


def contribution_weights_from_cache(
    cache: Any,
    model: Any,
    layer: int,
    *,
    kind: Kind = "intra",
    heads: int | Sequence[int] | None = None,
    tokens: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> ContributionResult:
    """Contribution weights of one layer from an ``ActivationCache`` you already have.

    The cache needs ``blocks.{layer}.attn.hook_pattern``, ``hook_v``, ``hook_z`` and
    ``blocks.{layer}.hook_attn_out`` (a plain ``model.run_with_cache(tokens)`` has them; to
    keep it small use ``names_filter=cw_lens.cache_names(layer)``).

    Args:
        cache: An ``ActivationCache`` (or a dict) with the classic hook names.
        model: The bridge the cache came from (for ``W_O`` and ``b_O``).
        layer: The layer to analyse.
        kind: ``"intra"`` or ``"inter"``.
        heads: Query heads (``None`` = all).
        tokens: The token ids the cache was computed on (for token strings); optional.
        attention_mask: 1 at real tokens when the cached batch was padded (right padding).
    """
    _check_kind(kind)
    check_model(model)
    (layer,) = resolve_layers(model, layer)
    head_list = resolve_heads(model, heads)
    acts = activations_from_cache(cache, model, layer, tokens=tokens, attention_mask=attention_mask)
    lc = LayerContributions(acts, None if len(head_list) == model.cfg.n_heads else head_list)
    n_nan = lc.n_zero_rows(kind)
    if n_nan:
        warnings.warn(
            f"{n_nan} (head, query) rows have a numerically zero output norm; their weights "
            "are NaN.",
            RuntimeWarning,
            stacklevel=2,
        )
    out_norm = lc.output_norm(kind).masked_fill(lc.zero_rows(kind), math.nan)
    batch = acts.batch
    return ContributionResult(
        attention=lc.masked_attention()[:, None],
        cosine=lc.cosine(kind)[:, None],
        projected_value_norm=lc.projected_value_norm[:, None],
        output_norm=out_norm[:, None],
        head_output_norm=lc.head_output_norm[:, None],
        tokens=batch.tokens,
        mask=batch.mask,
        str_tokens=batch.str_tokens(model)
        if tokens is not None
        else [[str(i) for i in range(int(n))] for n in batch.lengths],
        layers=[layer],
        heads=head_list,
        kind=kind,
        prepend_bos=batch.prepend_bos,
        bos_token=batch.bos_token,
        n_nan_rows=n_nan,
        model_name=str(getattr(model.cfg, "model_name", "")),
    )


def activations_from_cache(
    cache: Any,
    model: Any,
    layer: int,
    *,
    tokens: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> LayerActivations:
    """Build checked :class:`LayerActivations` for one layer from a cache."""
    names = {kind: hook_name(kind, layer) for kind in ("pattern", "values", "z", "attn_out")}
    got = {}
    for kind, name in names.items():
        try:
            got[kind] = cache[name]
        except (KeyError, IndexError):
            got[kind] = None
        if got[kind] is None:
            raise InputError(
                f"The cache has no {name!r}. Cache layer {layer} with "
                f"model.run_with_cache(tokens, names_filter=cw_lens.cache_names({layer}))."
            )
    pattern, values, z, attn_out = (got[k].detach() for k in names)
    cfg = model.cfg
    n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    if pattern.ndim == 3:  # run_with_cache(remove_batch_dim=True)
        pattern, values, z, attn_out = (t[None] for t in (pattern, values, z, attn_out))
    expected = {
        "pattern": (cfg.n_heads, None, None),
        "values": (None, n_kv, cfg.d_head),
        "z": (None, cfg.n_heads, cfg.d_head),
    }
    for kind, t in (("pattern", pattern), ("values", values), ("z", z)):
        if tuple(t.shape[1:]) != tuple(
            s if s is not None else t.shape[1 + i] for i, s in enumerate(expected[kind])
        ):
            raise InputError(
                f"The cache's {names[kind]} has shape {tuple(t.shape)}, which does not fit this "
                f"model ({cfg.n_heads} heads, {n_kv} kv heads, d_head {cfg.d_head}): the cache "
                "comes from another model."
            )
    if attn_out.shape[-1] != cfg.d_model:
        raise InputError(
            f"The cache's {names['attn_out']} has width {attn_out.shape[-1]} but the model's "
            f"d_model is {cfg.d_model}: the cache comes from another model."
        )
    n_pos = pattern.shape[-1]
    for kind, t in (("values", values), ("z", z), ("attn_out", attn_out)):
        if t.shape[1] != n_pos:
            raise InputError(
                f"The cache's {names[kind]} has {t.shape[1]} positions, the "
                f"pattern {n_pos}: the hooks come from different runs."
            )
    for kind, t in (("pattern", pattern), ("values", values), ("z", z), ("attn_out", attn_out)):
        if not bool(torch.isfinite(t).all()):
            raise InputError(
                f"The cache's {names[kind]} contains NaN or inf; contribution weights of "
                "non-finite activations are meaningless. Check the model run (dtype overflow?)."
            )
    device = pattern.device
    w = LayerWeights.of(model, layer)
    w = LayerWeights(
        w.W_O.to(device), None if w.b_O is None else w.b_O.to(device), w.gram.to(device)
    )
    out = attn_out.float() - (w.b_O if w.b_O is not None else 0)
    n_batch = pattern.shape[0]
    if attention_mask is None:
        mask = torch.ones(n_batch, n_pos, dtype=torch.bool, device=device)
    else:
        mask = torch.as_tensor(attention_mask, device=device).bool().reshape(n_batch, n_pos)
    if tokens is None:
        token_ids = torch.zeros(n_batch, n_pos, dtype=torch.long)
    else:
        token_ids = torch.as_tensor(tokens).reshape(n_batch, n_pos).cpu()
    bos_id = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer else None
    batch = TokenBatch(
        token_ids,
        mask.cpu(),
        bool(tokens is not None and bos_id is not None and (token_ids[:, 0] == bos_id).all()),
        getattr(model.tokenizer, "bos_token", None) if model.tokenizer else None,
        list(range(n_batch)),
    )
    return LayerActivations(
        layer=layer,
        pattern=pattern.float(),
        values=values.float(),
        z=z.float(),
        layer_output=out,
        weights=w,
        mask=mask,
        batch=batch,
    )
