r"""Input-level faithfulness: which input tokens does the prediction need? Every attribution
method researchers use, on one ERASER protocol, against random, recency and the reachable range.

**Protocol** (the comprehensiveness and sufficiency tests of DeYoung et al. 2020, "ERASER"). For
every item a target position `t` and its target: on task items the answer (teacher-forced over
its tokens, predicted from the last prompt position `t`), on text the last token. The
candidates are the input tokens `j < t` (BOS excluded by default, below). Each method scores
every candidate; the candidates are ranked by the score (`signed`, the default: the largest
score first; `signed=False`: by `|score|`). For each fraction `f` in {1, 5, 10, 20, 50}%,
`k = round(f n)` of the `n` candidates (at least one) are removed:

- *comprehensiveness*: the top `k` (a faithful ranking removes what the answer needs: a large
  drop);
- *sufficiency*: the bottom `k` (a faithful ranking leaves what the answer needs: a small drop).

**Removal** masks the token as a key in every layer and head (its attention probabilities set
to 0 for every query, without renormalising: [`cw_lens.mask_attention`][cw_lens.mask_attention]).
We chose masking over replacing the embedding by a baseline: there is no neutral embedding (a
zero, padding or mask vector is itself an input the model never saw, and moves every later
position's representation), while masking removes exactly what the other positions read from
the token and leaves the positions and the sequence length as they were. The target
position's own token stays (it lives in its residual stream). BOS is not a candidate unless
`exclude_bos=False`: masking the attention sink in every layer is a change of the model's
operating point rather than the removal of an input word, and it would reward whichever method
ranks BOS first.

**Measure**: the drop of the target's log-probability, `log p_clean - log p_removed`, and per
item the area over the perturbation curve, `AOPC = mean_f drop(f)`. Raw AOPC does not compare
across models or items, so each item's AOPC is also normalised by the range any ranking can
reach on the same bins (Edin et al. 2024, "Normalized AOPC: Fixing Misleading Faithfulness
Metrics for Feature Attribution Explainability"):

    NAOPC = (AOPC - AOPC_lower) / (AOPC_upper - AOPC_lower)

The bounds are found by a greedy search (Edin et al. use a beam search; this is its width 1):
grow the removed set one token at a time, each time adding the token whose removal gives the
largest (upper) or smallest (lower) drop, and read the drops at the bins' sizes. The orderings
of comprehensiveness and of sufficiency form the same family of nested sets, so both share
the bounds: comprehensiveness near 1 and sufficiency near 0 are best. Greedy bounds lie
inside the true range, so a normalised value may fall a little outside [0, 1]; it is reported
unclipped. Items whose range is below `1e-6` nats are left out of the normalised means.

**Methods** (docs/methods.md#input-deletion gives each formula and citation):

| name | score of candidate `j` | passes per sequence |
|---|---|---|
| `contribution_rollout` | `R[t, j]`, contribution shares composed over layers (cw_lens) | 1 |
| `attention_rollout` | Abnar & Zuidema 2020 | (shared) |
| `contribution` | `sum_l sum_h C_l[t, j]^h`, the inter-head contribution weights | 1 |
| `alti` | `sum_l sum_h` ALTI's L1 proximity at row `t` | 1 |
| `attribution_patching` | `sum_{l,h,i} alpha_ij dlog p/dalpha_ij` (first order) | 1 + 1 backward |
| `input_x_gradient` | `<e_j, dlog p/de_j>` (captum) | 1 + 1 backward |
| `integrated_gradients` | captum, zero baseline, 32 steps | 32 + 32 backward |
| `value_zeroing` | Mohebbi et al. 2023, `VZ_l[t, j]` averaged over layers | `T + 1` |
| `recency` | `j`: the nearest token first (a control: position alone) | 0 |
| `random` | seeded uniform scores, `n_random` draws (the control) | 0 |

Then `len(methods + draws) * 2 * 5` removal passes, and with `normalise` about
`2 k_max n` more for the bounds (`k_max`: the 50% bin).

Example:

    import cw_lens
    model = cw_lens.load_model()
    items = cw_lens.load_corpus("ioi", n_docs=32, model=model)
    result = cw_lens.input_deletion(model, items)
    result.aopc()      # per mode and method
    result.naopc()     # normalised by the reachable range
    result.plot()
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from cw_lens.analyses.faithfulness import MODES, n_removed, rank_candidates
from cw_lens.analyses.faithfulness.ranking import alti_scores
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.data.inputs import TokenBatch, iter_batches
from cw_lens.data.scoring import answer_logprobs, run_logits
from cw_lens.data.streaming import stream_contributions
from cw_lens.flow.evaluation import target_items
from cw_lens.flow.rollout import rollout_batches
from cw_lens.models.access import Model
from cw_lens.models.blocks import run_blocks
from cw_lens.models.gradients import attention_output_gradients
from cw_lens.models.input_gradients import DEFAULT_STEPS, embedding_attributions
from cw_lens.models.interventions import mask_attention
from cw_lens.models.value_zeroing import value_zeroing
from cw_lens.models.verify import require_flow

# One concept: the input-level test is its scores, its removals and its bounds; the scores are
# the methods' calls (each method's own module does its work), the rest is the protocol.
INPUT_METHODS = (
    "contribution_rollout",
    "attention_rollout",
    "contribution",
    "alti",
    "attribution_patching",
    "input_x_gradient",
    "integrated_gradients",
    "value_zeroing",
    "recency",
)
INPUT_FRACTIONS = (0.01, 0.05, 0.1, 0.2, 0.5)
# normalised AOPC leaves out items whose reachable range is below this (nats)
MIN_RANGE = 1e-6


# --------------------------------------------------------------------------- result


@saveable
@dataclass(repr=False)
class InputDeletionResult(Result):
    """Outcome of the input-level deletion test.

    `records`: one row per (item, method, draw, mode, fraction) with columns `item, method,
    draw, mode, fraction, k, n_candidates, clean_logprob, logprob, drop` (`drop =
    clean_logprob - logprob`). `items`: one row per item with `item, target_position,
    n_candidates, clean_logprob, lower, upper` (the greedy bounds of its AOPC; NaN without
    `normalise`) and `ig_completeness_error` (NaN unless integrated gradients ran).
    """

    records: pd.DataFrame
    items: pd.DataFrame
    corpus: str
    methods: list[str]
    fractions: list[float]
    n_random: int
    exclude_bos: bool
    signed: bool
    model_name: str = ""

    def to_dataframe(self) -> pd.DataFrame:
        """One record per (item, method, draw, mode, fraction).

        Returns:
            The records as a DataFrame (the target's log-probability drop per removal).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            result.to_dataframe().head()
            ```
        """
        return self.records

    def item_aopc(self) -> pd.DataFrame:
        """Each item's AOPC per (mode, method): the mean drop over the fractions (`random`:
        averaged over its draws too).

        Returns:
            A DataFrame indexed by item with `(mode, method)` columns.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            result.item_aopc()
            ```
        """
        df = self.records.dropna(subset=["drop"])
        per_draw = df.groupby(["item", "mode", "method", "draw"])["drop"].mean()
        return per_draw.groupby(["item", "mode", "method"]).mean().unstack(["mode", "method"])

    def aopc(self) -> pd.DataFrame:
        """AOPC per method (rows) and mode (columns), the mean over items.

        Returns:
            A DataFrame: comprehensiveness (higher is more faithful) and sufficiency (lower).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            result.aopc()
            ```
        """
        return self.item_aopc().mean().unstack("mode")

    def naopc(self) -> pd.DataFrame:
        """Normalised AOPC per method and mode: each item's AOPC placed in the range the greedy
        search reached on it, then averaged over the items with a range of at least 1e-6.

        Returns:
            A DataFrame like `aopc()` (comprehensiveness near 1 and sufficiency near 0 are
            best), plus a column `n_items`.

        Raises:
            InputError: When the result was computed without `normalise`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            result.naopc()
            ```
        """
        bounds = self.items.set_index("item")[["lower", "upper"]]
        if bounds.isna().all().all():
            raise InputError(
                "This result has no AOPC bounds: run input_deletion(..., normalise=True)."
            )
        span = bounds["upper"] - bounds["lower"]
        keep = span.index[span >= MIN_RANGE]
        per_item = self.item_aopc().loc[lambda d: d.index.isin(keep)]
        lower, width = bounds.loc[per_item.index, "lower"], span.loc[per_item.index]
        normalised = per_item.sub(lower, axis=0).div(width, axis=0)
        out = normalised.mean().unstack("mode")
        out["n_items"] = len(per_item)
        return out

    def summary(self) -> pd.DataFrame:
        """Mean drop per (mode, method, fraction) with its standard error over items.

        Returns:
            A DataFrame with `mean_drop`, `sem` and `n_items`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            result.summary()
            ```
        """
        df = self.records.dropna(subset=["drop"])
        keys = ["mode", "method", "fraction"]
        per_item = df.groupby([*keys, "item"])["drop"].mean().reset_index()
        out = per_item.groupby(keys)["drop"].agg(mean_drop="mean", sem="sem", n_items="count")
        return out.reset_index()

    def top(self, k: int = 10) -> pd.DataFrame:
        """The methods by comprehensiveness AOPC (most faithful first), with sufficiency.

        Args:
            k: How many methods.

        Returns:
            A DataFrame with one row per method.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            result.top(3)
            ```
        """
        table = self.aopc().sort_values("comprehensiveness", ascending=False)
        return table.head(k).rename_axis("method").reset_index()

    def plot(self, **kwargs: Any) -> Any:
        """Every method's comprehensiveness and sufficiency curve, side by side.

        Args:
            **kwargs: Passed to `cw_lens.plots.flow.plot_input_deletion` (`figsize`).

        Returns:
            A matplotlib Figure.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
            result = cw_lens.input_deletion(
                model, items, methods=("contribution_rollout",), n_random=1
            )
            fig = result.plot()
            ```
        """
        from cw_lens.plots import plot_input_deletion

        return plot_input_deletion(self, **kwargs)


# --------------------------------------------------------------------------- scores


def _seed(*parts: Any) -> int:
    return int(hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def _pair_sums(
    model: Any, sub: TokenBatch, methods: Sequence[str], targets: Tensor, loss: Callable
) -> dict[str, Tensor]:
    """`contribution`, `alti` (sums at each row's target query) and `attribution_patching`
    (summed over every query) per key, summed over heads and layers: `[batch, key]`."""
    n_batch, width = sub.tokens.shape
    rows = torch.arange(n_batch, device="cpu")
    layers = list(range(model.cfg.n_layers))
    out: dict[str, Tensor] = {}
    if "contribution" in methods:
        total = torch.zeros(n_batch, width, width, device="cpu")

        def add(lc: Any) -> None:
            scores = lc.metric("contribution", kind="inter").float().nansum(1).cpu()
            total[:, lc.queries, lc.keys] += scores

        stream_contributions(
            model,
            sub.tokens,
            add,
            layers=layers,
            batch_size=None,
            attention_mask=sub.mask.long(),
            progress=False,
            reuse_buffers=True,  # summed inside the call
        )
        out["contribution"] = total[rows, targets]
    if "alti" in methods:
        positions = torch.arange(width, device=sub.mask.device)
        valid = (positions[None, :, None] >= positions[None, None, :]) & sub.mask[:, None, :]
        valid &= sub.mask[:, :, None]
        alti = torch.zeros(n_batch, width, width, device="cpu")

        def add_block(block: Any) -> None:
            scores = alti_scores(block, valid.to(block.resid_pre.device)).nansum(1).cpu()
            alti[:, : scores.shape[1], : scores.shape[2]] += scores

        run_blocks(model, sub, add_block, layers=layers)
        out["alti"] = alti[rows, targets]
    if "attribution_patching" in methods:
        grads = attention_output_gradients(model, sub, loss, layers=layers)
        # L = -log p, so -alpha dL/dalpha = alpha dlog p/dalpha: the predicted drop
        summed = sum(g.attribution().nansum((1, 2)).cpu() for g in grads.values())
        out["attribution_patching"] = torch.zeros(n_batch, width, device="cpu")
        out["attribution_patching"][:, : summed.shape[1]] = summed
    return out


def input_scores(
    model: Model,
    sub: TokenBatch,
    spans: Sequence[tuple[int, int]],
    methods: Sequence[str] = INPUT_METHODS,
    *,
    n_steps: int = DEFAULT_STEPS,
) -> tuple[dict[str, Float[Tensor, "batch pos"]], Tensor, Tensor | None]:
    """Every method's score of every input token for each row's target (the rankings'
    input).

    Args:
        model: A `TransformerBridge` or `HookedTransformer` the flow checks accept.
        sub: A batch of items (right-padded).
        spans: Per row, the target's token span `[start, end)`, predicted from `start - 1`.
        methods: Names from `INPUT_METHODS`.
        n_steps: Integration points of integrated gradients.

    Returns:
        `(scores, clean_logprob, ig_error)`: per method `[batch, pos]` (float32, host); the
        target's clean log-probability `[batch]`; integrated gradients' completeness error
        per row (`None` unless it ran).
    """
    targets = torch.tensor([s - 1 for s, _ in spans], device="cpu")
    rows = torch.arange(len(spans), device="cpu")
    tokens = sub.tokens

    def loss(logits: Tensor) -> Tensor:
        return -answer_logprobs(logits, tokens, spans).sum()

    def target(logits: Tensor, which: Tensor) -> Tensor:
        picked = [spans[r] for r in which.tolist()]
        return answer_logprobs(logits, tokens.to(logits.device)[which], picked)

    ((_, contribution, attention, logits),) = rollout_batches(model, sub, None, need_logits=True)
    clean = answer_logprobs(logits, tokens, spans).cpu()
    scores: dict[str, Tensor] = {}
    if "contribution_rollout" in methods:
        scores["contribution_rollout"] = contribution.cpu()[rows, targets]
    if "attention_rollout" in methods:
        scores["attention_rollout"] = attention.cpu()[rows, targets]
    scores.update(_pair_sums(model, sub, methods, targets, loss))
    error = None
    for method in ("input_x_gradient", "integrated_gradients"):
        if method in methods:
            attr = embedding_attributions(model, sub, target, method=method, n_steps=n_steps)
            scores[method] = attr.scores
            if attr.completeness_error is not None:
                error = attr.completeness_error
    if "value_zeroing" in methods:
        scores["value_zeroing"] = value_zeroing(model, sub).mean(1)[rows, targets]
    if "recency" in methods:
        positions = torch.arange(tokens.shape[1], dtype=torch.float32, device="cpu")
        scores["recency"] = positions.expand(len(spans), -1)
    return {m: scores[m] for m in methods}, clean, error


# --------------------------------------------------------------------------- removal


def _candidates(sub: TokenBatch, targets: Tensor, exclude_bos: bool) -> Bool[Tensor, "batch pos"]:
    pos = torch.arange(sub.tokens.shape[1], device="cpu")
    valid = (pos[None, :] < targets[:, None]) & sub.mask.cpu()
    if exclude_bos and sub.prepend_bos:
        valid &= pos[None, :] > 0
    return valid


def _removal_logprobs(
    model: Any,
    sub: TokenBatch,
    spans: Sequence[tuple[int, int]],
    rows: Tensor,
    removed: Bool[Tensor, "n pos"],
    rows_per_pass: int,
) -> Tensor:
    """The target log-probability of batch row `rows[r]` with the keys `removed[r]` masked in
    every layer, for many rows per pass."""
    layers = range(model.cfg.n_layers)
    out = []
    for start in range(0, len(rows), rows_per_pass):
        which = rows[start : start + rows_per_pass]
        mask = removed[start : start + rows_per_pass].to(model.cfg.device)[:, None, None, :]
        tokens = sub.tokens[which]
        part = TokenBatch(tokens, sub.mask[which], sub.prepend_bos, sub.bos_token, which.tolist())
        hooks = [mask_attention(model, dict.fromkeys(layers, mask))]
        logits = run_logits(model, part, hooks)
        out.append(answer_logprobs(logits, tokens, [spans[r] for r in which.tolist()]).cpu())
        del logits
    return torch.cat(out) if out else torch.empty(0, device="cpu")


def _greedy_bounds(
    model: Any,
    sub: TokenBatch,
    spans: Sequence[tuple[int, int]],
    valid: Tensor,
    sizes: list[Tensor],
    clean: Tensor,
    rows_per_pass: int,
) -> tuple[Tensor, Tensor]:
    """Per row, the AOPC of the greedy largest-drop and smallest-drop orderings: `(lower,
    upper)`."""
    n_batch, width = valid.shape
    steps = max(int(s.max()) for s in sizes) if sizes else 0
    bounds = []
    for sign in (-1.0, 1.0):  # lower, then upper
        removed = torch.zeros(n_batch, width, dtype=torch.bool, device="cpu")
        at_size = torch.full((n_batch, steps + 1), math.nan, device="cpu")
        for step in range(steps):
            free = valid & ~removed
            row_of, key_of = free.nonzero(as_tuple=True)
            if len(row_of) == 0:
                break
            trial = removed[row_of].clone()
            trial[torch.arange(len(row_of), device="cpu"), key_of] = True
            drop = clean[row_of] - _removal_logprobs(
                model, sub, spans, row_of, trial, rows_per_pass
            )
            best = torch.full((n_batch,), -math.inf, device="cpu")
            best = best.scatter_reduce(0, row_of, sign * drop, reduce="amax")
            chosen = (sign * drop == best[row_of]).nonzero(as_tuple=True)[0]
            # the first key of a tie (nonzero lists keys in order): one per row
            first = torch.full((n_batch,), len(row_of), dtype=torch.long, device="cpu")
            first = first.scatter_reduce(0, row_of[chosen], chosen, reduce="amin")
            has = first < len(row_of)
            removed[row_of[first[has]], key_of[first[has]]] = True
            at_size[has, step + 1] = drop[first[has]]
        per_bin = torch.stack([at_size.gather(1, s[:, None])[:, 0] for s in sizes], dim=1)
        bounds.append(per_bin.mean(1))
    return bounds[0], bounds[1]


@check_keywords
def input_deletion(
    model: Model,
    corpus: Any,
    *,
    methods: Sequence[str] = INPUT_METHODS,
    fractions: Sequence[float] = INPUT_FRACTIONS,
    modes: Sequence[str] = MODES,
    n_random: int = 5,
    normalise: bool = True,
    signed: bool = True,
    exclude_bos: bool = True,
    n_steps: int = DEFAULT_STEPS,
    seed: int = 0,
    batch_size: int | None = 16,
    rows_per_pass: int = 64,
    progress: bool = True,
) -> InputDeletionResult:
    """Remove the top or bottom input tokens by each attribution method; measure the drop.

    Args:
        model: A `TransformerBridge` or `HookedTransformer` the flow checks accept.
        corpus: Task items (`load_corpus("ioi", ...)`: the answer is the target) or texts
            (the last token is the target).
        methods: Names from `INPUT_METHODS` (default: all nine).
        fractions: Shares of the candidates removed, each in (0, 1].
        modes: `comprehensiveness` (remove the top) and/or `sufficiency` (the bottom).
        n_random: Seeded random rankings, the control. Default 5: a draw costs what a
            method's removals cost (10 passes of short rows per batch), and five draws average
            the control's spread for little next to the methods' own scoring.
        normalise: Also find each item's AOPC bounds (greedy search) for `naopc()`.
        signed: Rank by the score (default; attributions that are negative oppose the answer);
            `False` ranks by `|score|`.
        exclude_bos: Keep position 0 out of the candidates (see the module's docstring).
        n_steps: Integration points of integrated gradients.
        seed: Seed of the random rankings (per item and draw).
        batch_size: Items per clean pass.
        rows_per_pass: `(item, removal)` rows per intervened forward pass.
        progress: Show a progress bar over item batches.

    Returns:
        An [`InputDeletionResult`][cw_lens.InputDeletionResult].

    Raises:
        InputError: On an unknown method or mode, a bad fraction or count.

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        items = cw_lens.load_corpus("ioi", n_docs=2, model=model)
        result = cw_lens.input_deletion(
            model, items, methods=("contribution_rollout", "attention_rollout"), n_random=2
        )
        result.aopc()
        ```
    """
    # Long: the option checks, then one loop per item batch (the methods' scores, every
    # ranking's removals in stacked passes, the greedy bounds) appending its records in place.
    methods = list(dict.fromkeys(methods))
    unknown = [m for m in methods if m not in INPUT_METHODS]
    if unknown or not methods:
        raise InputError(f"methods must be among {INPUT_METHODS}, got {methods}.")
    modes = list(dict.fromkeys(modes))
    if not modes or any(m not in MODES for m in modes):
        raise InputError(f"modes must be among {MODES}, got {modes}.")
    fractions = sorted({float(f) for f in fractions})
    if not fractions or fractions[0] <= 0 or fractions[-1] > 1:
        raise InputError(f"fractions must lie in (0, 1], got {fractions}.")
    for name, value, least in (("n_random", n_random, 0), ("rows_per_pass", rows_per_pass, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{name} must be an integer >= {least}, got {value!r}.")
    require_flow(model)
    batch, spans, name = target_items(model, corpus)
    rankings = [(m, 0) for m in methods] + [("random", d) for d in range(n_random)]
    records, items = [], []
    subs = list(iter_batches(batch, batch_size))
    for sub in tqdm(subs, desc="input deletion", disable=not progress, leave=False):
        sub_spans = [spans[d] for d in sub.documents]
        targets = torch.tensor([s - 1 for s, _ in sub_spans], device="cpu")
        scores, clean, ig_error = input_scores(model, sub, sub_spans, methods, n_steps=n_steps)
        valid = _candidates(sub, targets, exclude_bos)
        n_cand = valid.sum(-1)
        width = valid.shape[1]
        for d in range(n_random):
            scores[f"random/{d}"] = torch.stack(
                [torch.rand(width, generator=torch.Generator().manual_seed(_seed(seed, doc, d)),
                        device="cpu")
                 for doc in sub.documents]
            )  # fmt: skip
        sizes = [n_removed(n_cand, f) for f in fractions]
        configs, masks = [], []
        for method, draw in rankings:
            key = method if method != "random" else f"random/{draw}"
            rank = rank_candidates(scores[key], valid, signed=signed or method == "random")
            for mode in modes:
                for f, k in zip(fractions, sizes, strict=True):
                    low = torch.zeros_like(k) if mode == "comprehensiveness" else n_cand - k
                    high = k if mode == "comprehensiveness" else n_cand
                    masks.append((rank >= low[:, None]) & (rank < high[:, None]) & valid)
                    configs.append((method, draw, mode, f))
        n_rows = len(sub.documents)
        rows = torch.arange(n_rows, device="cpu").repeat(len(configs))
        removed = (
            torch.cat(masks) if masks else torch.zeros(0, width, dtype=torch.bool, device="cpu")
        )
        logprob = _removal_logprobs(model, sub, sub_spans, rows, removed, rows_per_pass)
        logprob = logprob.view(len(configs), n_rows)
        for c, (method, draw, mode, f) in enumerate(configs):
            k = sizes[fractions.index(f)]
            for r, doc in enumerate(sub.documents):
                ok = int(n_cand[r]) > 0
                lp = float(logprob[c, r]) if ok else math.nan
                records.append(
                    (doc, method, draw, mode, f, int(k[r]), int(n_cand[r]), float(clean[r]), lp,
                     float(clean[r]) - lp)
                )  # fmt: skip
        if normalise:
            lower, upper = _greedy_bounds(model, sub, sub_spans, valid, sizes, clean, rows_per_pass)
        else:
            lower = upper = torch.full((n_rows,), math.nan, device="cpu")
        for r, doc in enumerate(sub.documents):
            error = math.nan if ig_error is None else float(ig_error[r])
            items.append(
                (doc, int(targets[r]), int(n_cand[r]), float(clean[r]), float(lower[r]),
                 float(upper[r]), error)
            )  # fmt: skip
    cols = ["item", "method", "draw", "mode", "fraction", "k", "n_candidates", "clean_logprob"]
    item_cols = ["item", "target_position", "n_candidates", "clean_logprob", "lower", "upper"]
    return InputDeletionResult(
        pd.DataFrame(records, columns=[*cols, "logprob", "drop"]),
        pd.DataFrame(items, columns=[*item_cols, "ig_completeness_error"])
        .sort_values("item")
        .reset_index(drop=True),
        name,
        methods,
        fractions,
        n_random,
        exclude_bos,
        signed,
        getattr(model.cfg, "model_name", ""),
    )
