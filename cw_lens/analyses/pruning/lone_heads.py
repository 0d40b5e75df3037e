"""The cost of removing one head at a time ([`lone_head_costs`][cw_lens.lone_head_costs]), grouped
by rows so that one forward pass measures many heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import einops
import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from cw_lens.analyses.common import check_count
from cw_lens.analyses.pruning.orders import Head
from cw_lens.core.deprecation import keyword_only, renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.data.documents import Corpus, as_corpus
from cw_lens.data.inputs import TokenBatch, prepare_inputs
from cw_lens.data.scoring import token_nll
from cw_lens.models.access import Model
from cw_lens.models.capture import hook_name, resolve_heads, resolve_layers, run_layers
from cw_lens.models.verify import require_verified


def check_lone_heads(model: Any, heads: Sequence[Head] | None, layers: list[int]) -> list[Head]:
    if heads is None:
        return [(layer, h) for layer in layers for h in range(model.cfg.n_heads)]
    out = []
    for pair in heads:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"lone_heads must be (layer, head) pairs, got {pair!r}.")
        layer, head = (int(x) if isinstance(x, np.integer) else x for x in pair)
        (layer,) = resolve_layers(model, [layer])
        (head,) = resolve_heads(model, [head])
        out.append((layer, head))
    if not out:
        raise InputError("lone_heads is empty; pass None for every head or lone=False to skip.")
    return sorted(set(out))


def _row_group_removal(
    groups: Sequence[Head | None], n_rows: int, n_heads: int
) -> list[tuple[str, Any]]:
    """Hooks that zero `hook_z` of head `groups[g]` in rows `g*n_rows .. (g+1)*n_rows`."""
    rows = torch.arange(len(groups) * n_rows, device="cpu") // n_rows
    return row_removal(rows, [() if head is None else (head,) for head in groups], n_heads)


def row_removal(
    group_of_row: Tensor, removed: Sequence[Sequence[Head]], n_heads: int
) -> list[tuple[str, Any]]:
    """Hooks that zero `hook_z` of the heads `removed[g]` in the batch rows of group `g`
    (`group_of_row[row]`)."""
    # the (group, layer, head) table is filled on the host (numpy: no tensor operation per
    # head); each layer's [row, 1, head, 1] mask is then one gather of its groups' rows
    layers = sorted({layer for heads in removed for layer, _ in heads})
    position = {layer: i for i, layer in enumerate(layers)}
    table = np.zeros((len(removed), len(layers), n_heads), dtype=bool)
    for g, heads in enumerate(removed):
        for layer, h in heads:
            table[g, position[layer], h] = True
    rows = torch.from_numpy(table).to(group_of_row.device)[group_of_row]  # [row, layer, head]
    masks = {layer: rows[:, i, None, :, None] for layer, i in position.items()}

    def zero(z: Tensor, hook: Any, mask: Tensor) -> Tensor:
        return z.masked_fill(mask.to(z.device), 0.0)

    return [
        (hook_name("z", layer), lambda z, hook, mask=mask: zero(z, hook, mask))
        for layer, mask in sorted(masks.items())
    ]


@check_keywords
@renamed_kwargs(n_tokens="max_tokens")
@keyword_only("heads")
def lone_head_costs(
    model: Model,
    corpus: Any,
    *,
    heads: Sequence[Head] | None = None,
    n_docs: int | None = 2,
    max_tokens: int | None = 32,
    heads_per_pass: int = 8,
    prepend_bos: bool = True,
    progress: bool = True,
) -> tuple[float, pd.DataFrame]:
    """ΔPPL of removing each head alone (zeroing its `hook_z`) on a small corpus.

    All documents go in one batch; `heads_per_pass` heads share a forward pass, each on its
    own copy of the rows. The defaults (2 documents x 32 tokens) give a rough ranking;
    `max_tokens=64` doubles the cost and ranks the heads more reliably. To re-measure a few
    candidates on a whole corpus, pass `heads=[...], n_docs=None, max_tokens=None`.

    Args:
        model: A `TransformerBridge`.
        corpus: Documents; the first `n_docs` (`None` = all) are used, each cut to
            `max_tokens` text tokens (`None` = whole).
        heads: Candidate `(layer, head)` pairs (`None` = every head).
        n_docs: Use the first `n_docs` documents of `corpus` (`None` = all).
        max_tokens: Cut each document to `max_tokens` text tokens (`None` = whole), as
            `load_corpus(max_tokens=...)` does; `n_tokens=` is its deprecated name.
        heads_per_pass: Heads measured per forward pass (memory grows with it: the logits of
            `heads_per_pass * n_docs` rows).
        prepend_bos: Prepend BOS (position 0 is then the usual sink).
        progress: Show a progress bar over the passes.

    Returns:
        `(clean_ppl, table)`; the table has `layer`, `head`, `ppl`, `delta_ppl`,
        `nll`, `delta_nll`, most costly first.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        corpus = cw_lens.load_corpus(n_docs=2, max_tokens=16, model=model)
        clean_ppl, table = cw_lens.lone_head_costs(model, corpus, progress=False)
        table.head()  # the most costly heads first
        ```
    """
    require_verified(model)
    check_count(heads_per_pass, "heads_per_pass")
    candidates = check_lone_heads(model, heads, list(range(model.cfg.n_layers)))
    batch = lone_head_batch(model, as_corpus(corpus), n_docs, max_tokens, prepend_bos)
    groups: list[Head | None] = [None, *candidates]
    nll: list[float] = []
    passes = range(0, len(groups), heads_per_pass)
    for start in tqdm(passes, desc="lone heads", disable=not progress, leave=False):
        nll += _grouped_nll(model, batch, groups[start : start + heads_per_pass])
    clean = nll[0]
    table = pd.DataFrame(candidates, columns=["layer", "head"])
    table["nll"] = nll[1:]
    table["ppl"] = np.exp(table["nll"])
    table["delta_ppl"] = table["ppl"] - math.exp(clean)
    table["delta_nll"] = table["nll"] - clean
    table = table.sort_values("delta_ppl", ascending=False, kind="stable")
    return math.exp(clean), table[["layer", "head", "ppl", "delta_ppl", "nll", "delta_nll"]]


def lone_head_batch(
    model: Any, docs: Corpus, n_docs: int | None, n_tokens: int | None, prepend_bos: bool
) -> TokenBatch:
    check_count(n_docs, "lone_docs", allow_none=True)
    check_count(n_tokens, "lone_tokens", allow_none=True)
    batch = prepare_inputs(
        model, docs if n_docs is None else docs[:n_docs], prepend_bos=prepend_bos
    )
    width = batch.tokens.shape[1]
    if n_tokens is not None:
        width = min(width, n_tokens + int(batch.prepend_bos))
    if width < 2:
        raise InputError("The lone-head corpus needs at least two tokens per document.")
    return TokenBatch(
        batch.tokens[:, :width],
        batch.mask[:, :width],
        batch.prepend_bos,
        batch.bos_token,
        batch.documents,
    )


def _grouped_nll(model: Any, batch: TokenBatch, groups: Sequence[Head | None]) -> list[float]:
    """Mean next-token NLL of `batch` with each group's head removed (`None` = none)."""
    n_rows = batch.tokens.shape[0]
    copies = TokenBatch(
        batch.tokens.repeat(len(groups), 1),
        batch.mask.repeat(len(groups), 1),
        batch.prepend_bos,
        batch.bos_token,
        list(range(n_rows * len(groups))),
    )
    hooks = _row_group_removal(groups, n_rows, model.cfg.n_heads)
    logits = run_layers(model, copies, None, layers=[], fwd_hooks=hooks, need_logits=True)
    nll = token_nll(logits, copies.tokens, copies.mask).double()
    per_group = einops.rearrange(nll, "(g r) p -> g (r p)", g=len(groups))
    return (per_group.nansum(-1) / (~per_group.isnan()).sum(-1)).tolist()
