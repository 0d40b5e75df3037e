r"""Patch the sink of one text and compare clean with patched, number by number (P1, live).

The sink-norm ablation of methods § Attention sinks (docs/methods.md#sinks)
([`cw_lens.patch_sink`][cw_lens.patch_sink], `pv_0^h -> lambda pv_0^h` in chosen layers and heads,
attention untouched, `lambda` in [0, 2]) applied to one text, with everything a reader wants to see
side by side for the clean and the patched pass:

- the top-k next-token probabilities at every position, `softmax(logits[t])`;
- the next-token NLL at every position, `-log p(x_{t+1} | x_{<=t})`, and its change;
- contribution weights ([`cw_lens.contribution_weights`][cw_lens.contribution_weights]) of chosen
  layers, with their three factors (attention, relative norm, cosine), for every head;
- per patched (layer, head): the mean output norm `||o_i^h||` and the mean alignment with the
  head's semantic cone `cos(o_i^h, u^h)` (`u^h`: the normalised mean of the head's non-sink
  projected values over the text), over the queries after the first sink — the measures of
  [`cw_lens.sink_ablation`][cw_lens.sink_ablation] with `effect="total"`, on one text.

Each pass is one forward pass (weights, logits and cone measures are read from the same run).
The clean pass does not depend on the patch, so it can be computed once and passed back in
(`clean=`); that is what the live widget ([`cw_lens.sink_patcher`][cw_lens.sink_patcher]) does on
every change. With the clean pass's residual stream (`stream=`, `cw_lens.interactive.resume`)
the patched pass starts at the first patched layer instead of at the embedding.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import pandas as pd
import torch
from jaxtyping import Float32, Int
from torch import Tensor

from cw_lens.analyses.common import check_sinks_inside
from cw_lens.analyses.contributions import (
    ContributionResult,
    check_result_memory,
    contribution_weights,
)
from cw_lens.analyses.sinks import SinkSpec
from cw_lens.core.deprecation import renamed_kwargs
from cw_lens.core.errors import InputError
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.core.schema import Axes
from cw_lens.data.inputs import TokenBatch, one_text, prepare_inputs
from cw_lens.data.scoring import token_nll
from cw_lens.interactive.cone_means import ConeMeans
from cw_lens.interactive.deprecations import warn_positional_top
from cw_lens.interactive.resume import CleanStream, ResumePlan
from cw_lens.models.access import Model, resolve_heads, resolve_layers
from cw_lens.models.edits import HookSet
from cw_lens.models.interventions import patch_sink


@saveable
@dataclass(frozen=True)
class PatchControls:
    """What to patch: a range of layers, heads, `lambda`, mode and sink positions.

    `layers` is an inclusive `(first, last)` range; `heads` `None` means all heads.
    Build validated controls with `of`; `to_dict` / `from_dict` give the
    JSON form the front end exchanges.
    """

    layers: tuple[int, int]
    heads: tuple[int, ...] | None = None
    scale: float = 0.0
    mode: Literal["scale", "norm_matched"] = "scale"
    sinks: tuple[int, ...] = (0,)

    @classmethod
    def of(
        cls,
        model: Model,
        *,
        layers: Any = None,
        heads: Any = None,
        scale: float = 0.0,
        mode: str = "scale",
        sink_positions: Sequence[int] = (0,),
    ) -> PatchControls:
        """Validated controls; errors are [`InputError`][cw_lens.InputError].

        The checks of [`cw_lens.patch_sink`][cw_lens.patch_sink] are included.

        Args:
            model: The model the controls are for.
            layers: `(first, last)` inclusive, one layer, a `range` or `None` (all).
            heads: `None`/`"all"` or head indices.
            scale: `lambda` in [0, 2] (0 removes the sink's value, 1 keeps it).
            mode: `"scale"` or `"norm_matched"`.
            sink_positions: The sink position(s).

        Returns:
            The [`PatchControls`][cw_lens.PatchControls].

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            from cw_lens.interactive.comparison import PatchControls

            controls = PatchControls.of(model, layers=(0, 1), heads=[0, 1], scale=0.5)
            ```
        """
        first, last = cls._layer_range(model, layers)
        if heads is None or (isinstance(heads, str) and heads == "all"):
            head_tuple = None
        else:
            head_tuple = tuple(resolve_heads(model, heads))
            if not head_tuple:
                raise InputError("heads is empty; give 'all' or at least one head index.")
        sinks = tuple(sorted({int(p) for p in sink_positions}))
        controls = cls((first, last), head_tuple, float(scale), mode, sinks)
        controls.hooks(model)  # patch_sink's own checks (scale range, mode, sink positions)
        return controls

    @staticmethod
    def _layer_range(model: Model, layers: Any) -> tuple[int, int]:
        """`(first, last)` of a `layers` control, as `PatchControls.of` reads it, checked."""
        if layers is None:
            first, last = 0, -1  # resolved below: the last layer
        elif isinstance(layers, int):
            first = last = layers
        elif isinstance(layers, range) and len(layers) > 0 and layers.step == 1:
            first, last = layers[0], layers[-1]
        else:
            pair = list(layers) if isinstance(layers, list | tuple) else []
            if len(pair) != 2:
                raise InputError(
                    f"layers must be a range (first, last), one layer or None, got {layers!r}; "
                    "patch_sink itself takes any list of layers."
                )
            first, last = pair
        first, last = resolve_layers(model, [first])[0], resolve_layers(model, [last])[0]
        if first > last:
            raise InputError(f"layers must run from first to last, got ({first}, {last}).")
        return first, last

    @property
    def layer_list(self) -> list[int]:
        return list(range(self.layers[0], self.layers[1] + 1))

    def hooks(self, model: Model, attention_mask: Tensor | None = None) -> HookSet:
        """The [`cw_lens.patch_sink`][cw_lens.patch_sink] hook set these controls stand for.

        Args:
            model: The model to patch.
            attention_mask: `[batch, pos]`, 1 at real tokens, for padded batches.

        Returns:
            A [`HookSet`][cw_lens.HookSet] (a context manager).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            from cw_lens.interactive.comparison import PatchControls

            controls = PatchControls.of(model, layers=(0, 1))
            with controls.hooks(model):
                logits = model("The cat sat on the mat.")
            ```
        """
        return patch_sink(
            model,
            layers=self.layer_list,
            heads=None if self.heads is None else list(self.heads),
            scale=self.scale,
            mode=self.mode,  # type: ignore[arg-type]
            sink_positions=self.sinks,
            attention_mask=attention_mask,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of the controls (what the widget's front end reads).

        Returns:
            A dict with `layers`, `heads`, `scale`, `mode` and `sinks`.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            from cw_lens.interactive.comparison import PatchControls

            PatchControls.of(model, layers=(0, 1), scale=0.5).to_dict()
            ```
        """
        return {
            "layers": list(self.layers),
            "heads": "all" if self.heads is None else list(self.heads),
            "scale": self.scale,
            "mode": self.mode,
            "sinks": list(self.sinks),
        }

    @classmethod
    def from_dict(cls, model: Model, data: dict[str, Any]) -> PatchControls:
        """Validated controls from their JSON form (what the widget's front end sends).

        Args:
            model: The model the controls are for.
            data: The JSON form ([`to_dict`][cw_lens.PatchControls.to_dict]).

        Returns:
            The [`PatchControls`][cw_lens.PatchControls].

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            from cw_lens.interactive.comparison import PatchControls

            data = PatchControls.of(model, layers=(0, 1), scale=0.5).to_dict()
            PatchControls.from_dict(model, data)
            ```
        """
        unknown = set(data) - {"layers", "heads", "scale", "mode", "sinks"}
        if unknown:
            raise InputError(f"Unknown patch controls {sorted(unknown)}.")
        return cls.of(
            model,
            layers=data.get("layers"),
            heads=data.get("heads"),
            scale=data.get("scale", 0.0),
            mode=data.get("mode", "scale"),
            sink_positions=data.get("sinks", (0,)),
        )


@saveable
@dataclass
class SinkRun:
    """One pass over one text (clean, or under a patch): what the views show.

    Attributes:
        weights: Contribution weights (and their factors) of the requested layers, all heads.
        top_ids, top_probs: The `k` most probable next tokens at every position `[pos, k]`.
        nll: `-log p(x_{t+1} | x_{<=t})` for `t = 0 .. n - 2`.
        cone_layers: The layers whose `norm` and `cone` rows are given.
        norm, cone: `[layer, head]` mean `||o_i^h||` and `cos(o_i^h, u^h)` over the
            queries after the first sink (NaN for a head with no such query).
    """

    weights: ContributionResult
    top_ids: Int[Tensor, "pos k"]
    top_probs: Float32[Tensor, "pos k"]
    nll: Float32[Tensor, " pos_minus_1"]
    cone_layers: Annotated[list[int], Axes("layer")]
    norm: Float32[Tensor, "layer head"]
    cone: Float32[Tensor, "layer head"]
    sinks: tuple[int, ...] = (0,)

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())


def run_text(
    model: Any,
    batch: TokenBatch,
    *,
    layers: Sequence[int],
    patch: PatchControls | None = None,
    cone_layers: Sequence[int] = (),
    sinks: Sequence[int] = (0,),
    kind: str = "intra",
    top_k: int = 5,
    memory_budget: float | str | None = None,
) -> SinkRun:
    """One forward pass of a one-text batch, clean (`patch=None`) or under `patch`.

    Args:
        model: The loaded model.
        batch: One text, tokenized.
        layers: Layers whose contribution weights to keep.
        patch: The sink patch to apply, or None for the clean pass.
        cone_layers: Layers whose output norms and cone alignment to measure.
        sinks: The sink positions for the cone alignment.
        kind: `"intra"` or `"inter"` contribution weights.
        top_k: How many next-token predictions to keep.
        memory_budget: As for [`contribution_weights`][cw_lens.contribution_weights].

    Returns:
        The pass's contribution weights, cone means and top predictions.
    """
    if batch.tokens.shape[0] != 1:
        raise InputError("run_text takes one text (a batch of one row).")
    n_vocab = model.cfg.d_vocab
    if not 1 <= int(top_k) <= n_vocab:
        raise InputError(f"top_k must be in 1..{n_vocab}, got {top_k!r}.")
    cone_list = sorted(set(cone_layers))
    cone = ConeMeans(cone_list, model.cfg.n_heads, SinkSpec(sinks))
    got: dict[str, Tensor] = {}

    def keep_logits(_: TokenBatch, logits: Tensor) -> None:
        got["logits"] = logits[0].float()

    with contextlib.ExitStack() as stack:
        if patch is not None:  # entered as a context: cw_lens's checks know the edit
            stack.enter_context(patch.hooks(model))
        weights = contribution_weights(
            model,
            batch.tokens,
            layers=list(layers),
            kind=kind,  # type: ignore[arg-type]
            on_logits=keep_logits,
            on_block=cone,
            block_layers=cone_list,
            memory_budget=memory_budget,
        )
    logits = got["logits"]
    probs, ids = logits.softmax(-1).topk(int(top_k), dim=-1)
    nll = token_nll(logits[None], batch.tokens, batch.mask)[0]
    norm, cos = cone.means()
    sink_tuple = tuple(sorted({int(p) for p in sinks}))
    return SinkRun(weights, ids.cpu(), probs.cpu(), nll.cpu(), cone_list, norm, cos, sink_tuple)


@saveable
@dataclass(repr=False)
class SinkPatchComparisonResult(Result):
    """Result of [`compare_sink_patch`][cw_lens.compare_sink_patch]: the clean and the patched
    `SinkRun`."""

    controls: PatchControls
    clean: SinkRun
    patched: SinkRun
    str_tokens: list[str]
    token_strings: dict[int, str] = field(default_factory=dict)

    @property
    def delta_nll(self) -> float:
        """Mean next-token NLL change over the text (patched - clean)."""
        return self.patched.mean_nll - self.clean.mean_nll

    def to_dataframe(self) -> pd.DataFrame:
        """Per position `t`: the next token and its NLL, clean and patched, and the change.

        Returns:
            A DataFrame, one row per scored position.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cmp = cw_lens.compare_sink_patch(model, "The cat sat on the mat.", scale=0.0)
            cmp.to_dataframe().head()
            ```
        """
        n = len(self.str_tokens)
        return pd.DataFrame(
            {
                "position": range(n - 1),
                "token": self.str_tokens[:-1],
                "next_token": self.str_tokens[1:],
                "nll_clean": self.clean.nll.numpy(),
                "nll_patched": self.patched.nll.numpy(),
                "delta_nll": (self.patched.nll - self.clean.nll).numpy(),
            }
        )

    @warn_positional_top
    def top(self, k: int = 10, *, position: int | None = None) -> pd.DataFrame:
        """The top-k next tokens after `position`, clean and patched.

        Args:
            k: How many tokens (at most the `top_k` the comparison kept). Until 0.3.3 `top(n)`
                read `n` as the position; a positional argument now warns (FutureWarning).
            position: The position (default: the last; keyword only).

        Returns:
            A DataFrame with the clean and the patched candidates and their probabilities.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cmp = cw_lens.compare_sink_patch(model, "The cat sat on the mat.", scale=0.0)
            cmp.top(k=3)
            ```
        """
        n = len(self.str_tokens)
        t = n - 1 if position is None else int(position)
        if not 0 <= t < n:
            raise InputError(f"position must be in 0..{n - 1}, got {position!r}.")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}.")
        rows = []
        for rank in range(min(k, self.clean.top_ids.shape[1])):
            row: dict[str, Any] = {"rank": rank + 1}
            for name, run in (("clean", self.clean), ("patched", self.patched)):
                tid = int(run.top_ids[t, rank])
                row[f"{name}_token"] = self.token_strings.get(tid, str(tid))
                row[f"{name}_prob"] = float(run.top_probs[t, rank])
            rows.append(row)
        return pd.DataFrame(rows)

    def heads(self) -> pd.DataFrame:
        """Per patched (layer, head): mean output norm and cone alignment, clean and patched.

        Returns:
            A DataFrame, one row per patched head.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            cmp = cw_lens.compare_sink_patch(model, "The cat sat on the mat.", scale=0.0)
            cmp.heads().head()
            ```
        """
        rows = []
        for li, layer in enumerate(self.patched.cone_layers):
            ci = self.clean.cone_layers.index(layer)
            for h in range(self.patched.norm.shape[1]):
                rows.append(
                    {
                        "layer": layer,
                        "head": h,
                        "patched_head": self.controls.heads is None or h in self.controls.heads,
                        "norm_clean": float(self.clean.norm[ci, h]),
                        "norm_patched": float(self.patched.norm[li, h]),
                        "cone_clean": float(self.clean.cone[ci, h]),
                        "cone_patched": float(self.patched.cone[li, h]),
                    }
                )
        return pd.DataFrame(rows)


def token_strings(model: Any, ids: Tensor) -> dict[int, str]:
    """`{id: string}` for the token ids in `ids` (decoded one by one, like the text)."""
    tok = model.tokenizer
    unique = sorted({int(i) for i in ids.flatten().tolist()})
    return {i: (str(i) if tok is None else tok.decode([i])) for i in unique}


@check_keywords
@renamed_kwargs(text="inputs")
def compare_sink_patch(
    model: Model,
    inputs: str | Tensor,
    *,
    layers: Any = None,
    heads: Any = None,
    scale: float = 0.0,
    mode: str = "scale",
    sink_positions: Sequence[int] = (0,),
    view_layers: Sequence[int] | None = None,
    kind: str = "intra",
    top_k: int = 5,
    clean: SinkRun | None = None,
    memory_budget: float | str | None = None,
    stream: CleanStream | None = None,
) -> SinkPatchComparisonResult:
    """Run `inputs` clean and with the sink patched; everything the views show, both ways.

    Args:
        model: The bridge.
        inputs: One text (BOS is prepended: position 0 is the default sink), or its token
            ids `[1, pos]`; `text=` is its deprecated name.
        layers: Layers to patch: `(first, last)` inclusive, or `None` for all.
        heads: Heads to patch in those layers (`None` = all; `-1` is the last head).
        scale: `lambda` in [0, 2] (0 removes the sink's value, 1 keeps it, 2 doubles it).
        mode: `"scale"` or `"norm_matched"` (see [`cw_lens.patch_sink`][cw_lens.patch_sink]).
        sink_positions: The sink position(s), each a token of the text.
        view_layers: Layers whose contribution weights to keep (default: the patched ones).
        kind: `"intra"` or `"inter"` contribution weights.
        top_k: How many next tokens to keep per position.
        clean: A clean `SinkRun` of this text from an earlier call (it must cover
            `view_layers` and the patched layers), to skip the clean pass.
        memory_budget: Bytes the two runs' contribution weights may take together (as for
            [`contribution_weights`][cw_lens.contribution_weights]); over it,
            [`MemoryBudgetError`][cw_lens.MemoryBudgetError] is raised before any pass.
        stream: The residual stream of the clean pass of `clean`
            (`cw_lens.interactive.resume.CleanStream`, recorded by `clean_run(..., stream=)`):
            the patched pass then starts at the first patched layer, bit-equal to the full
            pass (where that cannot be vouched for it runs in full and says why: `stream.note`).

    Returns:
        A [`SinkPatchComparisonResult`][cw_lens.SinkPatchComparisonResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        cmp = cw_lens.compare_sink_patch(model, "The cat sat on the mat.", scale=0.0)
        cmp.delta_nll          # the change of the mean NLL
        cmp.top(k=3)           # next tokens, clean and patched
        ```
    """
    batch = prepare_inputs(model, inputs)
    one_text("compare_sink_patch", batch.tokens.shape[0])
    first, last = PatchControls._layer_range(model, layers)
    view = range(first, last + 1) if view_layers is None else resolve_layers(model, view_layers)
    runs = 2 if clean is None else 1  # before any pass (the controls' checks verify the model)
    check_result_memory(model, batch, len(view), model.cfg.n_heads, memory_budget, copies=runs)
    controls = PatchControls.of(
        model,
        layers=layers,
        heads=heads,
        scale=scale,
        mode=mode,
        sink_positions=sink_positions,
    )
    check_sinks_inside(model, batch.tokens, controls.sinks)
    view = list(view)
    kw = dict(sinks=controls.sinks, kind=kind, top_k=top_k, memory_budget=memory_budget)
    if clean is None:
        clean = run_text(model, batch, layers=view, cone_layers=controls.layer_list, **kw)
    else:
        missing = set(view) - set(clean.weights.layers)
        missing |= set(controls.layer_list) - set(clean.cone_layers)
        same = (
            torch.equal(clean.weights.tokens, batch.tokens)
            and clean.sinks == controls.sinks
            and clean.weights.kind == kind
            and clean.top_ids.shape[1] == top_k
        )
        if missing or not same:
            raise InputError(
                "The clean run given does not match this text, sinks, kind and top_k or lacks "
                f"layers {sorted(missing)}; compute it with run_text(...) for these settings."
            )
    first = controls.layers[0]
    plan = ResumePlan(view, view, 0) if stream is None else stream.plan(model, batch, first, view)
    with plan.context(model):
        patched = run_text(
            model, batch, layers=plan.layers, patch=controls, cone_layers=controls.layer_list, **kw
        )
    patched.weights = plan.weights(clean.weights, patched.weights)
    ids = torch.cat([clean.top_ids.flatten(), patched.top_ids.flatten()])
    return SinkPatchComparisonResult(
        controls,
        clean,
        patched,
        batch.str_tokens(model)[0],
        token_strings(model, ids),
    )
