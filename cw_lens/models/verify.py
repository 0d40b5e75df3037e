"""Verifying that a model's hooks show what its attention computes, before any number is returned.

Contribution weights are only valid when the captured hooks satisfy (docs/methods.md#notation), per
layer and head:

    pattern @ v == z                               (GQA mapped: head h reads kv head h // (H/H_kv))
    sum_h z^h W_O^h + b_O == the attention's real output (before any post-norm or multiplier)

[`verify_model`][cw_lens.verify_model] runs a short seeded probe (2 sequences x 16 random tokens)
and checks both identities on every layer — the real output is read with a PyTorch forward hook on
the attention module (`model.blocks[l].attn`), not from `hook_attn_out`. On a `TransformerBridge` it
also runs the wrapped Hugging Face model with every bridge component swapped back for the original
module (no TransformerLens code in the pass) and compares the logits, so a bridge that computes
an architecture wrongly is caught even when its hooks agree with each other. It refuses models
whose values are clamped after `hook_v` (OLMo's `clip_qkv`). Then it checks every
intervention on one layer: under it, the attention module's output must equal
`(z - delta) W_O + b_O` with the exact edit `delta` computed independently from the clean
probe (`patch_sink`, `mask_attention`, `remove_heads`). Last, the hooks the flow analyses
read (`cw_lens.models.blocks.run_blocks`: `hook_resid_pre`, `hook_attn_out`,
`hook_resid_mid`, `hook_mlp_out`, `hook_resid_post`) must all fire on the probe and add up
(the block checks of `cw_lens.models.blocks`); a model that fails them keeps its
contribution weights but its flow analyses are refused (`report.flow`,
`require_flow`).

All of this is read in one probe pass, each check while its layer is in
(`cw_lens.models.verify_probe`): a layer-streamed model is verified with one de-quantisation
of each decoder layer. A check the pass cannot settle runs in a pass of its own, as before:
the others when the flow checks refuse the model, the interventions when a later layer's hook
order changes the route they act on.

Every analysis calls `require_verified` first (the result is cached per model), so a model
that fails gets [`UnsupportedModelError`][cw_lens.UnsupportedModelError] naming the architecture,
the layer, the failed identity and the size of the error — never a number.

The public functions' docstrings have runnable examples.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from cw_lens.core.errors import UnsupportedModelError
from cw_lens.core.geometry import grouped_scores_values
from cw_lens.core.keywords import check_keywords
from cw_lens.core.registry import saveable
from cw_lens.core.results import Result
from cw_lens.models.access import (
    Model,
    ModelAccess,
    Route,
    StreamDone,
    check_model,
    model_access,
    probe_tokens,
)
from cw_lens.models.arguments import Api
from cw_lens.models.batch import TokenBatch
from cw_lens.models.blocks import run_blocks
from cw_lens.models.verify_probe import (
    INTERVENTIONS,
    Probe,
    edit_hooks,
    first,
    probe_edits,
    probe_pass,
    unbridged_logits,
)

# relative errors allowed: (identities, logits) by parameter dtype
# (float64 models: the edits and checks of interventions run in float32 -> about 1e-7)
TOLERANCES = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-4, 1e-3)}
HALF_PRECISION_TOLERANCES = (3e-2, 5e-2)
PROBE_BATCH, PROBE_LENGTH = 2, 16


@saveable
@dataclass(repr=False)
class ModelVerificationResult(Result):
    """What [`verify_model`][cw_lens.verify_model] found.

    Attributes:
        architecture, api, dtype: The model.
        route: `"hook_z"` or `"attention output"` (where pattern-dependent interventions act).
        layers: One row per layer: `pattern_v_z` and `output` (relative errors of the two
            identities) and the hook firing order.
        logits_vs_hf: Relative error of the bridge's logits against the unbridged Hugging Face
            model (`None` for a HookedTransformer).
        interventions: `{name: "exact (...)" | "refused: why"}`.
        flow: `"exact (...)"` or `"refused: why"` for the flow analyses (residual shares,
            rollout, routes), which read the residual-stream hooks.
        problems: Why the model is refused (empty when `ok`).
        warnings: What the user should know (e.g. processed weights).
        tolerances: `(identities, logits)` relative tolerances used.
    """

    architecture: str
    api: Api
    dtype: str
    route: Route
    layers: pd.DataFrame
    logits_vs_hf: float | None
    interventions: dict[str, str]
    flow: str = ""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tolerances: tuple[float, float] = (1e-4, 1e-3)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dataframe(self) -> pd.DataFrame:
        """One row per layer: the largest error of each identity checked there.

        Returns:
            The per-layer table (`layers`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            report = cw_lens.verify_model(model)
            report.to_dataframe().head()
            ```
        """
        return self.layers

    def top(self, k: int = 10) -> pd.DataFrame:
        """The `k` layers farthest from exact: rows of `layers`, the largest relative error
        of the two identities (`pattern_v_z`, `output`) first.

        Examples:
            >>> import cw_lens
            >>> model = cw_lens.load_model("testing:tiny-llama")
            >>> list(cw_lens.verify_model(model).top(1).columns[:3])
            ['layer', 'pattern_v_z', 'output']

        Args:
            k: How many layers.

        Returns:
            `k` rows of `layers`, the largest relative error first.
        """
        worst = self.layers[["pattern_v_z", "output"]].max(axis=1)
        order = worst.sort_values(ascending=False, kind="stable").index
        return self.layers.loc[order].head(k).reset_index(drop=True)

    def raise_if_failed(self) -> None:
        """Raise when a check failed; do nothing when every check passed.

        Raises:
            UnsupportedModelError: Naming the architecture, the layer, the failed identity and the
                size of the error.

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            report = cw_lens.verify_model(model)
            report.raise_if_failed()  # every identity holds on this model
            ```
        """
        if self.problems:
            more = (
                f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            )
            raise UnsupportedModelError(
                f"cw_lens cannot analyse this {self.architecture} model: {self.problems[0]}{more}. "
                "cw_lens.verify_model(model) lists every check."
            )

    def summary_dict(self) -> dict[str, Any]:
        """The verdict and the largest errors.

        Returns:
            A JSON-ready dict (`summary()`: this as a one-row DataFrame; `summary_text()` /
            `str()`: the readable report).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            report = cw_lens.verify_model(model)
            report.summary_dict()
            ```
        """
        return {
            "architecture": self.architecture,
            "api": self.api,
            "dtype": self.dtype,
            "ok": self.ok,
            "max_error_pattern_v_z": float(self.layers["pattern_v_z"].max()),
            "max_error_output": float(self.layers["output"].max()),
            "logits_vs_hf": self.logits_vs_hf,
            "route": self.route,
            "n_problems": len(self.problems),
        }

    def summary_text(self) -> str:
        """The readable report: the verdict, each identity's largest error and the interventions.

        Returns:
            The report as text (also `str(report)`).

        Examples:
            ```python
            import cw_lens

            model = cw_lens.load_model("testing:tiny-llama")
            report = cw_lens.verify_model(model)
            print(report.summary_text())
            ```
        """
        lines = [
            f"{self.architecture} ({self.api}, {self.dtype}): "
            + ("verified" if self.ok else "REFUSED"),
            f"  pattern @ v == z: max relative error {self.layers['pattern_v_z'].max():.2g}",
            f"  sum_h z W_O + b_O == attention output: max relative error "
            f"{self.layers['output'].max():.2g}",
        ]
        if self.logits_vs_hf is not None:
            lines.append(
                f"  logits vs the Hugging Face model: relative error {self.logits_vs_hf:.2g}"
            )
        lines.append(f"  interventions act on: {self.route}")
        lines += [f"  {name}: {verdict}" for name, verdict in self.interventions.items()]
        lines.append(f"  flow analyses: {self.flow}")
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __str__ = summary_text

    def _repr_markdown_(self) -> str:
        return "```\n" + self.summary_text() + "\n```"


def _relative(a: Tensor, b: Tensor) -> float:
    """`||a - b|| / ||b||` in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def _attention_under(access: ModelAccess, tokens: Tensor, hook_set: Any, layer: int) -> Tensor:
    """The output of `layer`'s attention module in a pass under `hook_set` that ends there
    (the interventions' own pass, where the probe pass's re-run did not settle them)."""
    got: dict[str, Tensor] = {}

    def keep(module: Any, args: Any, output: Any) -> None:
        got["attention"] = first(output).detach().clone()
        raise StreamDone

    with torch.inference_mode(), hook_set:
        with access.module_hooks([(access.attention_module(layer), keep)]):
            try:
                access.probe_forward(tokens)
            except StreamDone:
                pass
    if "attention" not in got:
        raise UnsupportedModelError(
            f"{access.architecture}: the attention module of layer {layer} did not run "
            "in a forward pass; cw_lens cannot read this model's attention output."
        )
    return got["attention"]


def _identities(access: ModelAccess, got: dict) -> pd.DataFrame:
    rows = []
    for layer in range(access.n_layers):
        g = got[layer]
        w = g["weights"].to(g["z"].device)
        mixed = grouped_scores_values(g["pattern"].double(), g["values"].double())
        out = torch.einsum("bphd,hdm->bpm", g["z"].double(), w.W_O.double())
        if w.b_O is not None:
            out = out + w.b_O.double()
        rows.append(
            {
                "layer": layer,
                "pattern_v_z": _relative(mixed, g["z"]),
                "output": _relative(out, g["out"]),
                "hook_order": " < ".join(access.hook_order[layer]),
            }
        )
    return pd.DataFrame(rows)


def _check_interventions(
    access: ModelAccess, tokens: Tensor, probe: Probe, tol: float
) -> dict[str, str]:
    """Each intervention on one layer: the attention module's output under it must differ from
    the clean one by exactly `-delta W_O`, with `delta` computed independently from the
    clean probe (the edit of `z` the intervention stands for). The outputs under the edits
    are the probe pass's re-runs of the layer (`cw_lens.models.verify_probe`), or, where
    those did not settle them, read in a pass per intervention."""
    layer = probe.layer
    g = probe.clean[layer]
    pattern, values, z = g["pattern"].float(), g["values"].float(), g["z"].float()
    w = g["weights"].to(z.device)
    read = probe.interventions_read
    edits = probe.edits if read else probe_edits(access, layer, pattern)
    verdicts: dict[str, str] = {}
    for name, edit in edits.items():
        if read:
            under, route = probe.intervened[name], probe.routes[name]
        else:
            hook_set, route = edit_hooks(access, name, edit, access.route)
            under = _attention_under(access, tokens, hook_set, layer)
        change = torch.einsum("bphd,hdm->bpm", edit.delta(pattern, values).double(), w.W_O.double())
        clean_out = g["attention"].double()
        err = float((under.double() - clean_out + change).norm()) / max(
            float(clean_out.norm()), 1e-30
        )
        verdicts[name] = (
            f"exact ({route})"
            if err <= tol
            else f"refused: under it the attention output differs from the exact edit "
            f"(relative error {err:.2g}, tolerance {tol:g})"
        )
    return verdicts


def _check_flow(access: ModelAccess, tokens: Tensor) -> str:
    """The flow analyses' hooks in a pass of their own, where they refused the probe pass:
    every block delivered and checked."""
    n_batch, n_pos = tokens.shape
    mask = torch.ones(n_batch, n_pos, dtype=torch.bool, device=tokens.device)
    batch = TokenBatch(tokens, mask, False, None, list(range(n_batch)))
    kinds: set[str] = set()

    def note(block: Any) -> None:
        kinds.add("sequential" if block.resid_mid is not None else "parallel")
        if block.attn_map.gain is not None:
            kinds.add("post-norm linearised")

    try:
        run_blocks(access.model, batch, note, layers=list(range(access.n_layers)))
    except UnsupportedModelError as err:
        return f"refused: {err}"
    return f"exact ({', '.join(sorted(kinds))} blocks)"


def _config_problems(access: ModelAccess) -> list[str]:
    clip = getattr(access.hf_config, "clip_qkv", None)
    if clip is not None:
        return [
            f"values are clamped to ±{clip} (clip_qkv) inside the attention, after hook_v, so "
            "hook_v is not what the model attends over"
        ]
    return []


def _weight_warnings(access: ModelAccess, clean: dict) -> list[str]:
    from cw_lens.models.weight_processing import processing_warnings

    facts = [clean[layer]["facts"] for layer in range(access.n_layers)]
    return list(processing_warnings(access.model, facts))


def _identity_problems(layers: pd.DataFrame, tol: float) -> list[str]:
    problems = []
    for row in layers.itertuples():
        if row.pattern_v_z > tol:
            problems.append(
                f"layer {row.layer}: pattern @ v != z (relative error {row.pattern_v_z:.2g}, "
                f"tolerance {tol:g}) — hook_v is not the value the attention averages"
            )
            break
    for row in layers.itertuples():
        if row.output > tol:
            problems.append(
                f"layer {row.layer}: sum_h z W_O + b_O != the attention output (relative error "
                f"{row.output:.2g}, tolerance {tol:g}) — W_O/b_O do not describe the attention's "
                "output projection"
            )
            break
    return problems


_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@check_keywords
def verify_model(model: Model, *, force: bool = False) -> ModelVerificationResult:
    """Check that cw_lens's numbers are exact on `model` (see the module docstring).

    The result is cached per model object; `force=True` re-runs the checks (after you change
    the model's weights, say).

    Args:
        model: A TransformerLens model.
        force: Re-run the checks (after you change the model's weights, say).

    Returns:
        A [`ModelVerificationResult`][cw_lens.ModelVerificationResult].

    Examples:
        ```python
        import cw_lens

        model = cw_lens.load_model("testing:tiny-llama")
        report = cw_lens.verify_model(model)
        report.ok                 # True: every identity holds
        print(report.summary_text())
        ```
    """
    check_model(model)  # a name such as "gpt2" is not a model: say how to load it
    cached = _VERIFIED.get(model) if not force else None
    if cached is not None:
        return cached
    access = model_access(model)
    dtype = access.parameter_dtype()
    tol, tol_logits = TOLERANCES.get(dtype, HALF_PRECISION_TOLERANCES)
    problems = _config_problems(access)
    length = min(PROBE_LENGTH, access.n_ctx or PROBE_LENGTH)
    tokens = probe_tokens(access, PROBE_BATCH, length)
    try:  # one pass for every check (a streamed layer is de-quantised once)
        probed, flow_in_pass = probe_pass(access, tokens, flow=True), True
    except Exception:  # the flow checks refused it (or the pass failed): the other checks
        # in a pass of their own, which raises what they raise
        probed, flow_in_pass = probe_pass(access, tokens, flow=False), False
    clean = probed.probe.clean
    layers = _identities(access, clean)
    problems += _identity_problems(layers, tol)
    logits_vs_hf = None
    if access.api == "bridge":
        if probed.hf_error is not None:
            raise probed.hf_error
        hf_logits = probed.hf_logits
        if hf_logits is None:
            hf_logits = unbridged_logits(access, tokens)
        logits_vs_hf = _relative(probed.logits.float(), hf_logits.float())
        if logits_vs_hf > tol_logits:
            problems.append(
                f"the bridge's logits differ from the Hugging Face model's (relative error "
                f"{logits_vs_hf:.2g}, tolerance {tol_logits:g}): TransformerLens computes this "
                "architecture differently from Hugging Face, so every number would be wrong"
            )
    if problems:
        interventions = {name: "refused: the model failed verification" for name in INTERVENTIONS}
        flow = "refused: the model failed verification"
    else:
        interventions = _check_interventions(access, tokens, probed.probe, tol)
        if flow_in_pass:
            flow = f"exact ({', '.join(sorted(probed.flow_kinds or ()))} blocks)"
        else:  # the verdict of a pass of their own (which raises what it raises)
            flow = _check_flow(access, tokens)
    result = ModelVerificationResult(
        architecture=access.architecture,
        api=access.api,
        dtype=str(dtype).replace("torch.", ""),
        route=access.route,
        layers=layers,
        logits_vs_hf=logits_vs_hf,
        interventions=interventions,
        flow=flow,
        problems=problems,
        warnings=_weight_warnings(access, clean),
        tolerances=(tol, tol_logits),
    )
    _VERIFIED[model] = result
    if result.warnings:
        import warnings

        for message in result.warnings:
            warnings.warn(message, UserWarning, stacklevel=2)
    return result


def require_verified(model: Any) -> ModelVerificationResult:
    """[`verify_model`][cw_lens.verify_model] (cached), raising
    [`UnsupportedModelError`][cw_lens.UnsupportedModelError] on a failed check."""
    result = verify_model(model)
    result.raise_if_failed()
    return result


def require_flow(model: Any) -> ModelVerificationResult:
    """`require_verified`, and refuse a model whose flow-analysis hooks failed the probe."""
    result = require_verified(model)
    if result.flow.startswith("refused"):
        raise UnsupportedModelError(
            "cw_lens's flow analyses (residual shares, rollout, routes) cannot run on this "
            f"model: {result.flow.removeprefix('refused: ')} Contribution weights and the other "
            "analyses are unaffected."
        )
    return result
